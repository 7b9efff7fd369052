"""Judging a step from its agreed verdict: applied, an fp16 overflow, or an anomaly, and what the
run does about an anomaly (``integrity.on_anomaly``, and the limit that ends a run which keeps
finding them).

Torch only (the verdict's tensors); every rank runs the same judge on the same numbers.
"""

from __future__ import annotations

import collections
import math

from ..config.integrity import IntegritySection
from .spikes import SpikeWatch
from .verdict import Verdict


class StepAnomaly(Exception):
    """A step judged anomalous, raised alike on every rank where the run rolls back or stops: its
    update was applied nowhere. ``anomaly``: the event's fields; ``cursor``: the step's first sample."""

    def __init__(self, step: int, anomaly: dict, cursor: int):
        self.step, self.anomaly, self.cursor = step, anomaly, cursor
        super().__init__(f"step {step}: {describe(anomaly)}; {anomaly.get('action')}")

    def __reduce__(self):   # Ray sends it to the controller inside its task error
        return (StepAnomaly, (self.step, self.anomaly, self.cursor))


def describe(a: dict) -> str:
    """One line naming an anomaly."""
    if a["anomaly"] == "corruption":
        return f"the state of ranks {a['ranks']} changed since their last check while nothing wrote it (their checksum)"
    if a["anomaly"] == "nonfinite":
        where = f" on ranks {a['ranks']}" if a.get("ranks") else ""
        return f"{a['signal']} is {a['value']}{where}"
    return (f"{a['signal']} {a['value']:.4g} spiked above its median {a['median']:.4g} of the last steps "
            f"(bar {a['bar']:.4g})")


def _number(x: float) -> float | str:
    return x if math.isfinite(x) else repr(x)   # "nan", "inf": records and events stay JSON


class AnomalyJudge:
    """What a rank makes of each step's verdict, and of the anomalies so far."""

    def __init__(self, section: IntegritySection, fp16: bool):
        self.section, self.fp16 = section, fp16
        self.spikes = SpikeWatch(section.spikes, section.spike_window, section.spike_min_history,
                                 section.spike_mads, {"loss": section.spike_ratio_loss,
                                                      "grad_norm": section.spike_ratio_grad_norm})
        self.recent: collections.deque[tuple] = collections.deque()   # (step, try) of the anomalies in the window

    def judge(self, step: int, v: Verdict) -> tuple[str, dict | None]:
        """``("apply", None)``, ``("overflow", None)`` (fp16: a gradient overflowed at this loss
        scale; the scaler's business) or ``("anomaly", fields)``."""
        if v.changed_at_rest:
            return "anomaly", {"anomaly": "corruption", "signal": "state", "step": step,
                               "value": "changed at rest", "ranks": v.flagged()}
        if not v.finite:
            if self.fp16 and v.loss_finite:
                return "overflow", None
            loss_bad = not v.loss_finite or (v.loss is not None and not math.isfinite(v.loss))
            signal = "loss" if loss_bad else "grad_norm"
            value = v.loss if loss_bad and v.loss is not None else v.grad_norm
            return "anomaly", {"anomaly": "nonfinite", "signal": signal, "step": step, "value": _number(value),
                               "ranks": v.flagged()}
        spikes = self.spikes.judge({"loss": v.loss, "grad_norm": v.grad_norm})
        if spikes:
            worst = max(spikes, key=lambda s: s["value"] / max(s["bar"], 1e-30))
            return "anomaly", {"anomaly": "spike", "step": step, "ranks": [], **worst,
                               "signals": [s["signal"] for s in spikes]}
        return "apply", None

    def accept(self, v: Verdict) -> None:
        self.spikes.accept({"loss": v.loss, "grad_norm": v.grad_norm})

    def action(self, step: int, attempt: int = 0) -> str:
        """What to do about an anomaly at the ``attempt``-th try of ``step``: the configured action,
        or ``stop`` where it is one more than ``max_anomalies`` within ``anomaly_window`` steps."""
        s = self.section
        if (step, attempt) not in self.recent:   # the same try run again (after a restore) counts once
            self.recent.append((step, attempt))
        while self.recent and self.recent[0][0] <= step - s.anomaly_window:
            self.recent.popleft()
        return "stop" if len(self.recent) > s.max_anomalies else s.on_anomaly

    def state(self) -> dict:
        return {"spikes": self.spikes.state(), "anomaly_steps": [list(x) for x in self.recent]}

    def load(self, state: dict | None) -> None:
        state = state or {}
        self.spikes.load(state.get("spikes"))
        self.recent = collections.deque(tuple(int(v) for v in x) for x in state.get("anomaly_steps", [])
                                        if isinstance(x, (list, tuple)))

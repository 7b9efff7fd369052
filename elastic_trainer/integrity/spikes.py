"""A robust spike rule: a value far above the median of its recent history.

A step's loss or gradient norm is a spike where it exceeds the median ``m`` of the last
``window`` accepted steps both by ``mads`` scaled median absolute deviations (``1.4826 * MAD``,
the standard deviation's robust estimate) and by its signal's factor ``ratio`` (``x > ratio * m``). The
first test alone alarms on a quiet stretch, where the MAD is tiny; the second alone on a noisy
one. Nothing is judged before ``min_history`` steps are in the window. Only accepted steps enter
it, so a spike never raises the bar for the next one.

Every rank holds the same history (the values are agreed over the world before they are judged,
and the history rides in snapshots), so every rank reaches the same verdict with no message.

Pure: no torch.
"""

from __future__ import annotations

import collections
import math
import statistics

SIGNALS = ("loss", "grad_norm")
_MAD_TO_SIGMA = 1.4826


class SpikeWatch:
    """The recent history of each signal and the rule that judges the next value."""

    def __init__(self, signals, window: int, min_history: int, mads: float, ratio: float | dict[str, float]):
        """``ratio``: one factor, or one per signal."""
        self.signals = tuple(signals)
        self.window, self.min_history, self.mads = window, min_history, mads
        self.ratio = ratio if isinstance(ratio, dict) else {s: ratio for s in SIGNALS}
        self.history = {s: collections.deque(maxlen=window) for s in SIGNALS}

    def judge(self, values: dict[str, float | None]) -> list[dict]:
        """The spikes among ``values`` (signal -> value; None: not known this step), each as
        ``{"signal", "value", "median", "bar"}``: empty where none."""
        out = []
        for s in self.signals:
            x, past = values.get(s), self.history[s]
            if x is None or len(past) < self.min_history:
                continue
            m = statistics.median(past)
            mad = statistics.median(abs(v - m) for v in past)
            bar = max(m + self.mads * _MAD_TO_SIGMA * mad, self.ratio[s] * m)
            if x > bar:
                out.append({"signal": s, "value": x, "median": m, "bar": bar})
        return out

    def accept(self, values: dict[str, float | None]) -> None:
        """An accepted step's values join the history (non-finite and unknown ones do not)."""
        for s in SIGNALS:
            x = values.get(s)
            if x is not None and math.isfinite(x):
                self.history[s].append(float(x))

    def state(self) -> dict[str, list[float]]:
        return {s: list(v) for s, v in self.history.items()}

    def load(self, state: dict | None) -> None:
        """Take a snapshot's history (None or a run without one: start empty)."""
        for s in SIGNALS:
            self.history[s].clear()
            for x in list((state or {}).get(s, []))[-self.window:]:
                self.history[s].append(float(x))

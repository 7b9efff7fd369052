"""A straggler left out as a spare: benched, re-planned around, probed, and let back in.

The last of ``balance``'s mitigations (``Balance.act`` decides when it
repays). Benching a worker is a live re-plan without it, taken like a grow:
the next step takes a snapshot, and the re-plan after it restores that step,
so nothing is redone. The benched worker stays alive and holds no rank; the
policy and the grow check count only the workers that are not benched.

A benched worker runs no steps, so its pace is read from a probe instead
(``worker.probe``): right after the re-plan (its slow baseline), and every
``balance.window`` steps after. Once its probe runs faster than that baseline
by more than ``balance.threshold`` it is let back in, and the grow check
re-plans onto it when the policy prefers the larger plan; if it is still slow
there, it is named and priced again like any straggler. (Its pace when
benched is not the yardstick: read on fewer micro-batches it can overstate
the slowdown, 3.25 for a 2x straggler in the benchmark, and a worker back to
full speed would never have matched it.) A worker that dies while benched is
dropped like any other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

from .workers import failed

if TYPE_CHECKING:
    from .controller import Controller

log = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 30.0


@dataclass
class Benched:
    wid: int
    rank: int            # the rank it held
    pace: float          # its pace when it was benched
    step: int            # the step it was benched after
    probe_s: float | None = None   # its probe right after the re-plan (the slow baseline)
    last_probe_s: float | None = None


class Bench:
    def __init__(self, ctl: "Controller"):
        self.ctl = ctl
        self.benched: dict[int, Benched] = {}
        self._probed_at = 0

    def usable(self) -> list[int]:
        """The live workers a plan may use: all but the benched."""
        return sorted(w for w in self.ctl.pool.workers if w not in self.benched)

    def bench(self, rank: int, pace: float, step: int) -> int | None:
        """Leave out the worker of ``rank`` and ask for the re-plan without it; its id, or None
        when it cannot be left out (its worker is gone)."""
        wid = self.ctl.ranks.get(rank)
        if wid is None or wid not in self.ctl.pool:
            return None
        self.benched[wid] = Benched(wid, rank, pace, step)
        self.ctl.recovery.request_replan("straggler")
        return wid

    def after_replan(self) -> None:
        """Take the slow baseline of each newly benched worker, now that it runs no steps."""
        fresh = [b for b in self.benched.values() if b.probe_s is None]
        for b, s in zip(fresh, self._probe([b.wid for b in fresh])):
            b.probe_s = b.last_probe_s = s

    def poll(self, step: int) -> list[dict]:
        """Every ``balance.window`` steps, probe the benched workers; returns the ``rebalance``
        events of those let back in."""
        pool = self.ctl.pool
        for wid in [w for w in self.benched if w not in pool]:
            del self.benched[wid]   # died while benched
        ready = [b for b in self.benched.values() if b.probe_s is not None]
        if not ready or step - self._probed_at < self.ctl.cfg.balance.window:
            return []
        self._probed_at = step
        events = []
        faster = 1 + self.ctl.cfg.balance.threshold
        for b, s in zip(ready, self._probe([b.wid for b in ready])):
            if s is None:
                continue
            b.last_probe_s = s
            now = b.pace * s / b.probe_s   # its pace now, as far as the probe tells
            if s * faster < b.probe_s:
                del self.benched[b.wid]
                events.append({"kind": "rebalance", "step": step, "action": "readmit", "worker": b.wid,
                               "rank_before": b.rank, "benched_steps": step - b.step, "pace": round(now, 3),
                               "probe_s": round(s, 6), "probe_s_benched": round(b.probe_s, 6)})
                log.info("[%s] worker %d is back to pace %.2f after %d steps benched: it may be grown onto",
                         self.ctl.run_name, b.wid, now, step - b.step)
        return events

    def _probe(self, wids: list[int]) -> list[float | None]:
        refs = [self.ctl.pool[w].actor.probe.remote() for w in wids]
        out = []
        for ref in refs:
            try:
                value = ray.get(ref, timeout=_PROBE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a dead or hung worker: the pool's own checks drop it
                value = None
            out.append(None if value is None or failed(value) else float(value))
        return out

    def describe(self) -> list[dict]:
        return [{"worker": b.wid, "rank_before": b.rank, "pace": round(b.pace, 3), "since_step": b.step,
                 "probe_s": b.last_probe_s} for b in self.benched.values()]

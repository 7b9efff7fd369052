"""The controller's side of stragglers: each step's per-rank compute into pace, events, and the record.

``pace`` is the pure part (``PaceTracker``); this joins it to the run: a new
plan resets it (ranks and stages change), every committed step's record gets
``rank_compute_s`` and ``rank_wait_s`` (each rank's own compute and its wait,
``worker.compute_clock``) and ``pace`` (each rank's median pace), and a rank
that turns slow or recovers is an event naming its worker and node.
"""

from __future__ import annotations

from ..config import BalanceSection
from .pace import PaceTracker


class Balance:
    def __init__(self, cfg: BalanceSection):
        self.cfg = cfg
        self.on = cfg.mode != "off"
        self.tracker = PaceTracker(cfg.threshold, cfg.window)

    def new_plan(self, topo) -> None:
        self.tracker.reset({r: topo.coords(r)[1] for r in range(topo.world_size)})

    def observe(self, step: int, results: dict, record: dict, where: dict[int, tuple]) -> list[dict]:
        """Add the pace of ``step`` to ``record`` (``results``: worker id -> its step result;
        ``where``: rank -> (worker id, node)); returns the straggler events to record."""
        if not self.on:
            return []
        compute = {o["rank"]: o.get("forward_s", 0.0) + o.get("backward_s", 0.0) + o.get("optimizer_s", 0.0)
                   for o in results.values()}
        record["rank_compute_s"] = {str(r): round(c, 6) for r, c in sorted(compute.items())}
        record["rank_wait_s"] = {str(o["rank"]): round(o.get("wait_s", 0.0), 6)
                                 for o in sorted(results.values(), key=lambda o: o["rank"])}
        paces, events = self.tracker.update(step, compute)
        record["pace"] = {str(r): round(p, 4) for r, p in sorted(paces.items())}
        for ev in events:
            wid, node = where.get(ev["rank"], (None, None))
            ev.update(worker=wid, node=node)
        return events

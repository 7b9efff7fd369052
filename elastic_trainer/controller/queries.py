"""What a running controller shows its callers: the progress the driver polls, and ``status``.

Read-only views of the controller's state, taken under its lock while
``run()`` goes on in another thread of the actor. What they return is a copy
made under that lock (the worker table under the pool's own): Ray serialises
the answer after the lock is let go, while the loop thread goes on changing
the originals (a recovery event gains its total when its first step commits).
Any client of the cluster may call these; none changes the run.
"""

from __future__ import annotations

import statistics
from typing import Callable

from .balance.stragglers import Balance
from .balance.benching import Bench
from .run.run_record import RunRecord
from .state.snapshot_schedule import SnapshotSchedule
from .run.workers import WorkerPool


class ControllerQueries:
    """The read-only answers of a running controller, from the parts it is given."""

    def __init__(self, run: RunRecord, pool: WorkerPool, schedule: SnapshotSchedule, balance: Balance,
                 bench: Bench, setup_memory: Callable[[], dict] = dict):
        self.run, self.pool, self.schedule, self.balance, self.bench = run, pool, schedule, balance, bench
        self.setup_memory = setup_memory   # rank -> its memory at the last set-up

    def progress(self, since: int, events_since: int = 0, ranks_since: int | None = None) -> dict:
        """Step records from index ``since`` of the history and events from ``events_since``;
        with ``ranks_since``, the per-rank figures of the steps after the first ``ranks_since``
        (``rank_figures``; ``ranks_dropped`` counts those gone before they were asked for).

        After a rollback the history is shorter than before; ``length`` tells the
        caller where it stands now.
        """
        run = self.run
        with run.lock:
            out = {"state": run.state.value, "records": run.history[since:], "length": len(run.history),
                   "events": [dict(e) for e in run.events[events_since:]], "n_events": len(run.events),
                   "plan": run.plan.describe() if run.plan else None}
            if ranks_since is not None:
                out["ranks"], out["ranks_dropped"] = run.rank_figures.since(ranks_since)
            return out

    def status(self) -> dict:
        """What ``elastic-trainer status`` shows: plan, step, throughput, recent failures."""
        run = self.run
        with run.lock:
            recent = run.history[-10:]
            return {"run": run.name, "state": run.state.value, "step": run.step,
                    "steps": run.cfg.train.steps, "last": run.history[-1] if run.history else None,
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recent) if recent else None,
                    "step_time_s": statistics.median(r["step_time_s"] for r in recent) if recent else None,
                    "plan": run.plan.describe() if run.plan else None,
                    "setting_up": run.setting_up,
                    "snapshots": self.schedule.describe(),
                    "workers": self.pool.table(),
                    "starting": self.pool.starting(),
                    "failures": [dict(e) for e in [e for e in run.events if e["kind"] == "failure"][-5:]],
                    "recoveries": sum(1 for e in run.events if e["kind"] == "recovery"),
                    "eval": _copy(next((e for e in reversed(run.events) if e["kind"] == "eval"), None)),
                    # A stop asked and not yet taken (the run ends after the steps in flight).
                    "stopping": _copy(next((e for e in reversed(run.events) if e["kind"] == "stop_requested"),
                                           None)),
                    "pace": run.rank_figures.last().get("pace") or {},
                    # Each rank's peak resident memory in the last step, and at its set-up.
                    "memory": {"step_peak_rss_bytes": run.rank_figures.last().get("rank_peak_rss_bytes") or {},
                               "step_peak_device_bytes": run.rank_figures.last().get("rank_peak_device_bytes") or {},
                               "setup": self.setup_memory()},
                    "stragglers": self.balance.tracker.stragglers,
                    "shares": list(self.balance.shares) if self.balance.shares else self.balance.shares,
                    "benched": self.bench.describe(),
                    # Integrity: nodes proven to corrupt data, which no plan uses again; the anomalies.
                    "quarantined": dict(self.pool.quarantined),
                    "quarantined_workers": sorted(self.pool.quarantined_workers),
                    "anomalies": sum(1 for e in run.events if e["kind"] == "anomaly"),
                    "goodput": run.goodput.report()}


def _copy(event: dict | None) -> dict | None:
    return dict(event) if event is not None else None

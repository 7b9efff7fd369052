"""Anomalous steps as the controller sees them (``integrity``).

Every rank judges each step from the same agreed numbers, so an anomaly comes to the controller
whole: in a committed step's results (``on_anomaly: skip``: the attempts skipped before it,
each with the batch it left out), or as the same mark from every rank in place of the step's
result, which ends its lease there (``rollback``, ``stop``, or a limit reached). Neither is a
failure: no worker is at fault, none is dropped and the failure budget is untouched. A rollback
is a re-plan on the same workers that restores the newest snapshot before the anomaly and
leaves out the batches since (``Replanner`` adds the window once it knows the restored step);
a stop ends the run after the last good step is saved, as a stop does, then FAILED with
``RunError`` (``RunRecord.halt``).
"""

from __future__ import annotations

import collections
import logging
import time

from ...config import TrainerConfig
from ...errors import WorkerError
from ...integrity.anomaly import describe
from ..run.orders import ReplanOrder
from ..run.run_record import RunRecord
from ..run.run_state import RunState
from ..stepping.one_step import StepOutcome

log = logging.getLogger(__name__)


class Anomalies:
    def __init__(self, cfg: TrainerConfig, run: RunRecord, where=None, corruption=None):
        """``where``: rank -> (worker id, node) of the plan in force, for the events;
        ``corruption``: the run's ``Corruption``, which a slice changed at rest goes to."""
        self.cfg, self.run, self.corruption = cfg, run, corruption
        self.where = where or (lambda: {})
        self.steps: collections.deque[tuple] = collections.deque()   # the anomalies' (step, batch) in the window

    def take(self, out: StepOutcome) -> dict | None:
        """A completed call's anomaly mark (``worker.step_answer.anomaly_answer``), taken out of
        ``out``: a lease keeps the steps before it (its snapshot, due at its last step, never
        happened), a single step keeps none. None where there is none. Raises ``WorkerError``
        where the ranks disagree, which agreed verdicts never do."""
        lists = {w: (r if isinstance(r, list) else [r]) for w, r in out.results.items()}
        marks = {w: r[-1] for w, r in lists.items() if r and r[-1].get("anomaly_mark")}
        if not marks:
            return None
        if len(marks) != len(lists) or len({len(r) for r in lists.values()}) != 1:
            raise WorkerError(f"ranks disagree whether step {next(iter(marks.values()))['step']} was anomalous: "
                              f"workers {sorted(marks)} of {sorted(lists)} said so")
        kept = {w: r[:-1] for w, r in lists.items()}
        out.count = len(next(iter(kept.values())))
        out.results = kept if out.count > 1 else {w: r[0] for w, r in kept.items()} if out.count else {}
        out.snapshot = False
        return next(iter(marks.values()))

    def committed(self, out: StepOutcome) -> None:
        """A committed step's skipped attempts: their batches left out of the run, their events."""
        first = next(iter(out.results.values()), {})
        for a in first.get("anomalies") or ():
            self.run.add_skip(*a["samples"])
            self._over_limit(a["step"], a["samples"][0])   # counted: the ranks stop a run past it within a lease
            self.record(a)

    def order(self, mark: dict, out: StepOutcome) -> ReplanOrder | None:
        """What an anomaly's mark calls for once the steps before it are recorded: the rollback's
        re-plan; or, for ``stop`` or past ``integrity.max_anomalies``, None, with the run asked to
        stop: its last good step is saved as at any stop, then it ends FAILED (``halt``)."""
        a, step = dict(mark["anomaly"]), mark["step"]
        if a["action"] == "quarantine" and self.corruption is not None:
            return self.corruption.proven(mark, out)
        if self._over_limit(step, mark["cursor"]):
            a["action"] = "stop"
        if a["action"] == "stop":
            self.record(a)
            why = ("integrity.on_anomaly: stop" if self.cfg.integrity.on_anomaly == "stop" else
                   f"more than integrity.max_anomalies={self.cfg.integrity.max_anomalies} within "
                   f"{self.cfg.integrity.anomaly_window} steps")
            self.run.halt = (f"step {step} was anomalous: {describe(a)}; the run stops ({why}). No rank applied "
                             f"it. Anomalies: {self.summary()}")
            self.run.request_stop(f"anomaly at step {step}")
            return None
        self.run.transition(RunState.RECOVERING, step=step)
        out.step = step
        return ReplanOrder("anomaly", time.perf_counter(), failed=out, plan_before=self.run.plan.describe(),
                           rollback={"anomaly": a, "cursor": mark["cursor"]})

    def record(self, a: dict, **more) -> None:
        """The ``anomaly`` event of ``a`` (its ranks' workers and nodes named)."""
        where = self.where()
        ranks = a.get("ranks") or []
        ev = {**{k: v for k, v in a.items() if k != "step"}, **more,
              "workers": [where[r][0] for r in ranks if r in where],
              "nodes": sorted({where[r][1] for r in ranks if r in where and where[r][1]})}
        self.run.event("anomaly", step=a["step"], **ev)
        log.warning("[%s] step %d anomalous: %s; %s%s", self.run.name, a["step"], describe(a), a.get("action"),
                    f" samples {a['samples']}" if a.get("samples") else "")

    def _over_limit(self, step: int, cursor: int) -> bool:
        """One more anomaly at ``step`` on the batch at ``cursor``: whether it is past
        ``max_anomalies`` in the window (the ranks count those of a lease; these count across
        re-plans and rollbacks too). The same step on the same batch, run again after a restore,
        counts once."""
        section = self.cfg.integrity
        if (step, cursor) not in self.steps:
            self.steps.append((step, cursor))
        while self.steps and self.steps[0][0] <= step - section.anomaly_window:
            self.steps.popleft()
        return len(self.steps) > section.max_anomalies

    def summary(self) -> str:
        evs = [e for e in self.run.events if e["kind"] == "anomaly"]
        return "; ".join(f"step {e['step']}: {e.get('anomaly')} {e.get('signal')} ({e.get('action')})"
                         for e in evs[-10:]) or "none before"

"""Growth: when to re-plan without a loss, handed over as a ``ReplanOrder``.

Three things ask for a re-plan between steps: workers that joined, where the
policy would choose a larger plan for them; a straggler left out as a spare;
a re-cut of the stages (both from balancing, ``request_replan``). Each waits
for a snapshot step, so that nothing is redone: ``maybe_grow`` asks the
schedule for one, and orders the re-plan right after it.
"""

from __future__ import annotations

import time

from ...config import TrainerConfig
from ...planning.policy import choose_plan, memory_bound
from ..balance.benching import Bench
from ..failures.fences import Fences
from ..run.orders import ReplanOrder
from ..run.run_record import RunRecord
from ..run.run_state import RunState
from ..state.snapshot_schedule import SnapshotSchedule
from ..run.workers import WorkerPool
from .drains import Drains
from .replacements import Replacements


class Growth:
    def __init__(self, cfg: TrainerConfig, run: RunRecord, pool: WorkerPool, bench: Bench,
                 schedule: SnapshotSchedule, fences: Fences):
        self.cfg, self.run, self.pool, self.bench, self.schedule, self.fences = cfg, run, pool, bench, schedule, fences
        self._last_check = time.monotonic()
        self._grow_wanted = False   # a larger plan waits for the next snapshot step
        self._reason: str | None = None   # a re-plan asked for (a straggler benched), likewise
        self._cut: tuple | None = None    # the stage cut a re-plan asked for keeps (a re-cut)
        # Preemption notices: planned departures.
        self.drains = Drains(run, pool, self.request_replan, snapshot=schedule.request)
        self.replacements = Replacements(cfg, run, pool)   # the autoscaler asked for what is missing

    def request_replan(self, reason: str, cut: tuple | None = None) -> None:
        """Re-plan on the usable workers at the next snapshot step, as a grow does (``reason``
        names it in the recovery event). ``cut``: keep the layout and every rank on its worker,
        with these stage bounds (where every worker of the plan is still usable)."""
        self._reason, self._cut = reason, cut

    def replan_pending(self) -> bool:
        """Whether a re-plan asked for (``request_replan``) is still to be taken."""
        return self._reason is not None

    def pending_cut(self) -> tuple | None:
        """The stage cut a re-plan asked for keeps, while it is still to be taken."""
        return self._cut

    def replanned(self) -> None:
        """A re-plan was carried out (this one or a failure's): it leaves every benched worker
        out and takes in every joined one, so what was asked for is done."""
        self._reason = self._cut = None

    def quiet(self) -> bool:
        """Whether ``maybe_grow`` would order nothing now: no re-plan asked for, and none wanted
        after looking for joined workers where a look is due (a lease may then be issued
        before the last one is committed)."""
        self.drains.poll()
        return self._reason is None and not self._grow_wanted and not self._look()

    def _look(self) -> bool:
        """Every ``scaling.grow_check_s``: start workers on free nodes, take in those that
        joined, and want a re-plan if the policy then prefers a larger plan; whether one is wanted."""
        now = time.monotonic()
        if now - self._last_check < self.cfg.scaling.grow_check_s:
            return False
        self._last_check = now
        self.poll_fences()
        self.pool.spawn_on_free_nodes()
        self.pool.await_joining(0, required=False)
        self.replacements.update()
        self._grow_wanted = self._larger_plan()
        return self._grow_wanted

    def poll_fences(self) -> None:
        """Record what became of the workers fenced out for silence (``fences``)."""
        for ev in self.fences.poll():
            self.run.event(ev.pop("kind"), **ev)

    def maybe_grow(self) -> ReplanOrder | None:
        """The re-plan due now, if any: onto workers that joined where the policy prefers a larger
        plan, or as ``request_replan`` asked; right after a snapshot step (nothing is redone),
        asking the schedule for one if none was just taken."""
        run = self.run
        self.drains.poll()
        if self._reason is None and not self._grow_wanted and not self._look():
            return None
        if self._reason == "drain" and not self.drains.ready():
            return None   # a replacement is starting, and the deadline leaves time to take it in
        if self.schedule.last_taken != run.step:
            self.schedule.request()  # the next step takes a snapshot; re-plan from it
            return None
        reason = self._reason
        if reason is None:
            self._grow_wanted = False
            if not self._larger_plan():  # still: a worker may have gone meanwhile
                return None
            reason = "grow"
        run.transition(RunState.RESIZING, workers=len(self.bench.usable()))
        run.points.reach("grow_ordered", step=run.step, reason=reason)
        return ReplanOrder(reason, time.perf_counter(), plan_before=run.plan.describe(), cut=self._cut)

    def _larger_plan(self) -> bool:
        """Whether spare workers would let the policy choose a plan larger than the current one."""
        pool = self.pool
        usable = self.bench.usable()
        if not any(pool[w].rank is None for w in usable):
            return False
        choice = choose_plan(self.cfg, len(usable), memory_bound(self.cfg))
        topo = self.run.plan.topology
        return not (choice is None or (choice.dp, choice.pp) == (topo.dp, topo.pp)
                    or choice.world_size <= topo.world_size)

"""Carrying out a re-plan order: choose a plan for the usable workers, set it up, restore.

Recovery (after a failure) and growth (joined workers, a straggler benched, a
re-cut) decide that the run must re-plan and hand that decision over as a
value, a ``ReplanOrder``; the step loop gives it to ``Replanner.carry_out``,
which alone chooses the next plan and sets it up (``PlanSetup``), restoring
the newest step every block can come from (``RestorePoints``). A set-up that
fails counts as one more failure (``FailureBudget``) and the re-plan starts
over on the workers left. The recovery event it records is completed by the
next committed step (``step_committed``).
"""

from __future__ import annotations

import logging
import time

from ...config import TrainerConfig
from ...errors import RunError, WorkerError
from ...planning.plan import plan_for
from ...planning.policy import choose_plan, layout_key, memory_bound, no_plan_reason
from ..balance.benching import Bench
from ..failures.failure_budget import FailureBudget
from ..failures.detect import out_of_memory
from ..failures.fences import Fences
from ..failures.memory_kills import MemoryKills
from .plan_setup import PlanSetup
from ..state.restore_points import RestorePoints
from ..run.run_record import RunRecord
from ..run.run_state import RunState
from ..failures.survivor_collectives import shrunk_ranks
from ..integrity.corruption import QUARANTINE_WAIT_S
from ..run.orders import ReplanOrder
from ..run.workers import WorkerPool

log = logging.getLogger(__name__)


class Replanner:
    def __init__(self, cfg: TrainerConfig, run: RunRecord, pool: WorkerPool, bench: Bench, setup: PlanSetup,
                 points: RestorePoints, budget: FailureBudget, fences: Fences, memory: MemoryKills):
        self.cfg, self.run, self.pool, self.bench, self.setup, self.points = cfg, run, pool, bench, setup, points
        self.budget, self.fences, self.memory = budget, fences, memory
        self.pending_event: dict | None = None   # the recovery event, completed at the next step
        # Layouts (policy.layout_key) whose set-up ran out of memory: not chosen again, not retried.
        self.unfit: dict[tuple, str] = {}
        self.on_rollback = None   # records an anomaly's rollback once it is set up (integrity.anomalies)

    def carry_out(self, order: ReplanOrder) -> None:
        """Re-plan on the usable workers and restore, as ``order`` says; a set-up that fails counts
        as a failure and the re-plan starts over. Raises ``RunError`` past the run's limits, or
        where no plan fits the workers there are."""
        run, pool, out = self.run, self.pool, order.failed
        step = out.step if out else run.step + 1   # the step that failed, or the next one
        attempts, retry_s = 0, 0.0
        shrunk, whole = order.shrunk, (order.whole if order.after_failure else None)
        if order.reason in ("anomaly", "corruption"):
            whole = None   # no worker failed: their groups are whole, asked of them as between steps
        if order.reason in ("drain", "quarantine"):
            # Groups are built anew: carrying those without the moved ranks (asked of the workers,
            # as a grow does) left the new worker and the survivors naming the new groups apart,
            # and the set-up waited out the rendezvous timeout before its retry built them all.
            whole = set()
        if order.reason in ("corruption", "quarantine") and self.pool.joining:
            # A worker proven to corrupt data trains no more: the replacement started for it is
            # waited for, so its ranks move there (the layout stays) rather than the run shrink.
            with run.goodput.phase("integrity"):
                pool.await_joining(QUARANTINE_WAIT_S, required=False)
        if order.abort_setups:
            self.setup.abort()
        cause = order.cause
        plan_bucket, restore_bucket = _buckets(order)
        while True:
            t0 = time.perf_counter()
            attempts += 1
            run.goodput.enter(plan_bucket)
            # Memory kills found so far: their hosts are avoided before the plan is chosen.
            cause = self._memory_kills(order, cause)
            pool.await_joining(0, required=False)
            with run.goodput.phase("waiting_for_nodes"):
                self._wait_for_min_workers()
            plan, ranks, why = self._next_plan(keep=order.after_failure, cut=order.cut,
                                               move=order.reason in ("drain", "quarantine", "corruption"))
            reuse = None
            kept = shrunk_ranks(shrunk, plan, pool) if ranks is None else None
            if kept is not None and any(w in self.bench.benched for w in kept.values()):
                kept = None   # a benched straggler holds no rank, in a shrunk world or any other
            if kept is not None:
                ranks, reuse = kept, shrunk.id
                why += "; the survivors keep their shrunk world (no rendezvous)"
            t1 = time.perf_counter()
            run.goodput.enter(restore_bucket)
            restore = self.points.restore_point(between_steps=not order.after_failure and attempts == 1,
                                                at_most=order.restore_at_most)
            if order.rollback is not None:
                # The batches from the one after the restored step to the anomalous one's are left out
                # (a retry restoring an earlier step widens the window).
                order.rollback["samples"] = run.skip_since(restore[0] if restore else 0, order.rollback["cursor"])
            try:
                desc = self.setup.apply(plan, restore, self.points.sources, self.points.durable_refs, ranks,
                                        reuse_world=reuse, whole=whole)
            except WorkerError as e:
                failed_workers = getattr(e, "failed_workers", [])
                run.event("failure", failure="during_recovery", worker=failed_workers, rank=None, node=None,
                          step=step, detail=str(e))
                if out_of_memory(str(e)):
                    self._unfit(plan, str(e))
                log.warning("[%s] set-up of the new plan failed: %s", run.name, e)
                self.budget.count()
                self.budget.check("during_recovery", str(e))
                # Drop whoever died. A live worker that failed is not at fault: it waited at
                # a rendezvous for a member that died. Abort the set-ups still waiting and let
                # them end before the next try, which would otherwise queue behind them.
                dead, silent = pool.dead_or_silent(list(pool.workers))
                if order.failure is not None:
                    # A worker that died loading its blocks may well have died of memory.
                    self.memory.watch([pool[w] for w in dead], step, order.failure)
                pool.drop(dead)
                self.fences.fence(silent, step, order.failure)
                self.setup.abort()
                retry_s += time.perf_counter() - t0
                # A failed attempt leaves the shrunk world and the carried groups in no known state.
                shrunk, whole = None, (set() if order.after_failure else None)
                continue
            cause = self._memory_kills(order, cause)
            self._record(order, cause, restore, desc, why, attempts, retry_s, t1, time.perf_counter())
            if order.rollback is not None and self.on_rollback is not None:
                self.on_rollback(order.rollback["anomaly"], samples=order.rollback["samples"],
                                 restored_step=restore[0] if restore else 0)
            self.bench.after_replan(run.step, self.setup.reset_refs)
            log.info("[%s] re-planned (%s) to dp=%d x pp=%d on %d of %d workers, restored step %d from %s",
                     run.name, order.reason, plan.topology.dp, plan.topology.pp, plan.topology.world_size,
                     len(pool), restore[0] if restore else 0, restore[2] if restore else "the seed")
            run.transition(RunState.RUNNING)
            run.goodput.enter("controller")   # until the next step is issued
            return

    def _unfit(self, plan, detail: str) -> None:
        """``plan``'s layout ran out of memory at its set-up: the next choice leaves it out."""
        topo = plan.topology
        key = layout_key(topo.dp, topo.pp, plan.stage_bounds)
        self.unfit[key] = detail
        self.run.event("layout_unfit", dp=topo.dp, pp=topo.pp, stages=[list(b) for b in plan.stage_bounds],
                       detail=detail[:500])
        log.warning("[%s] dp=%d x pp=%d, stages %s, ran out of memory at its set-up: not chosen again",
                    self.run.name, topo.dp, topo.pp, [list(b) for b in plan.stage_bounds])

    def _memory_kills(self, order: ReplanOrder, cause: str | None) -> str | None:
        """Record the memory kills found so far (``memory_kills``); this order's cause, "memory"
        where one of them was its failure's. Those of earlier failures name their recoveries'."""
        for ev in self.memory.poll():
            self.run.event(ev.pop("kind"), **ev)
            if order.failure is not None and ev["failure"] == order.failure:
                cause = "memory"
            else:
                self.run.name_cause(ev["failure"], "memory")
        return cause

    def _record(self, order: ReplanOrder, cause: str | None, restore, desc: dict, why: str, attempts: int,
                retry_s: float, t1: float, t2: float) -> None:
        """The recovery event, held until ``step_committed`` completes it with the first step's time."""
        run, out, detected = self.run, order.failed, order.detected
        failed_step = out.step if out else run.step + 1
        restored = restore[0] if restore else 0
        self.flush()   # a recovery that no step completed: this one took its place
        self.pending_event = run.hold_event(
            "recovery", reason=order.reason, cause=cause, failure=order.failure, failed_step=failed_step,
            restored_step=restored, timeline=[list(t) for t in run.timeline],
            steps_redone=failed_step - restored - (0 if out else 1),
            steps_rolled_back=run.rolled_back,
            plan_before=_plan_summary(order.plan_before), plan_after=_plan_summary(desc), policy=why,
            sources=restore[2] if restore else {}, detect_s=detected - (out.started if out else detected),
            replan_s=t1 - detected - retry_s, restore_s=t2 - t1, attempts=attempts, failed_attempts_s=retry_s,
            _resumed=t2,
            restore_parts=dict(self.setup.setup_timings), parts_from_holders=self.points.holder_reads,
            parts_relayed=self.points.relayed_reads,
            **self.setup.restore_moved, **order.settle_wait,
            # Leases granted behind the failed one (control.renew_early), dropped before they ran.
            leases_dropped=[list(d) for d in out.dropped] if out else [],
            first_signal_at=(time.time() - (time.perf_counter() - out.first_signal)) if out and out.first_signal else None,
            detected_at=time.time() - (time.perf_counter() - detected))

    def step_committed(self) -> None:
        """A step completed: the recovery in progress, if any, is complete; its event gets the
        first step's time and is shown (with its metrics), whole, for the first time."""
        ev, self.pending_event = self.pending_event, None
        if ev is None:
            return
        first = time.perf_counter() - ev["_resumed"]
        total = ev["detect_s"] + ev["replan_s"] + ev["restore_s"] + first
        log.info("[%s] recovered in %.2f s (detect %.2f, re-plan %.2f, restore %.2f, first step %.2f)",
                 self.run.name, total, ev["detect_s"], ev["replan_s"], ev["restore_s"], first)
        ev.pop("_resumed")
        self.run.publish(ev, first_step_s=first, total_s=total, resumed_at=time.time())

    def flush(self) -> None:
        """The run ends (or re-plans again) before a step completed the recovery under way: its
        event is shown as it is, with no first step."""
        ev, self.pending_event = self.pending_event, None
        if ev is not None:
            ev.pop("_resumed", None)
            self.run.publish(ev, first_step_s=None, total_s=None)

    def _next_plan(self, keep: bool, cut: tuple | None, move: bool = False) -> tuple:
        """(plan, rank -> worker id or None to place anew, why) for the workers usable now.

        With ``keep`` (after a failure) and every worker of the current plan alive, the
        plan stays as it is, each rank on its worker: nothing about the cluster changed,
        and a retry in place loads every block from the rank's own copy. A re-cut ``cut``
        likewise keeps every rank on its worker, with the new stage bounds. With ``move`` (a
        drain) and enough spare workers, the plan stays too, the leaving ranks on spares
        (``_moved_off``). Otherwise the policy chooses, by the planner's calibrated model.
        """
        run, bench, bound = self.run, self.bench, memory_bound(self.cfg)
        usable_ids = set(bench.usable())
        intact = run.plan is not None and all(w in usable_ids for w in run.ranks.values())
        if intact and layout_key(run.plan.topology.dp, run.plan.topology.pp, run.plan.stage_bounds) in self.unfit:
            intact = False   # its set-up ran out of memory: not kept, not retried
        if cut is not None and intact and len(cut) == len(run.plan.stage_bounds):
            topo = run.plan.topology
            plan = plan_for(self.cfg, topo.dp, topo.pp, cut, run.counts)
            return plan, dict(run.ranks), f"re-cut: stages {[list(b) for b in cut]}, each rank on its worker"
        if keep and intact:
            return self._same_layout(), dict(run.ranks), "kept: every worker of the plan is alive"
        moved = self._moved_off(usable_ids) if move and run.plan is not None else None
        if moved is not None:
            return (self._same_layout(), moved,
                    "kept: the leaving ranks moved to spare workers, every other rank on its worker")
        usable = len(usable_ids)
        choice = choose_plan(self.cfg, usable, bound, avoid=frozenset(self.unfit))
        if (choice is None or usable < self.cfg.scaling.min_workers) and bench.benched:
            # A slow worker beats none: take the benched back before giving up or waiting.
            for ev in bench.readmit_all("no plan fits the workers that are not benched"):
                run.event(ev.pop("kind"), **ev)
            usable = len(bench.usable())
            choice = choose_plan(self.cfg, usable, bound, avoid=frozenset(self.unfit))
        if choice is None:
            raise RunError(no_plan_reason(self.cfg, usable, bound) or f"no dp x pp fits {usable} workers")
        return plan_for(self.cfg, choice.dp, choice.pp, choice.stage_bounds, run.counts), None, choice.reason

    def _same_layout(self):
        """A plan of the current layout and stage cut, anew."""
        run = self.run
        topo = run.plan.topology
        return plan_for(self.cfg, topo.dp, topo.pp, run.plan.stage_bounds, run.counts)

    def _moved_off(self, usable_ids: set[int]) -> dict[int, int] | None:
        """The current plan's ranks with those whose workers may not be used (on a draining node)
        given to usable workers that hold no rank, the others kept on their workers; None where
        there are too few such workers, or the layout ran out of memory before."""
        run = self.run
        topo = run.plan.topology
        if layout_key(topo.dp, topo.pp, run.plan.stage_bounds) in self.unfit:
            return None
        ranks = {r: w for r, w in run.ranks.items() if w in usable_ids}
        free = sorted(usable_ids - set(ranks.values()))
        leaving = sorted(r for r in range(topo.world_size) if r not in ranks)
        if len(free) < len(leaving):
            return None
        ranks.update(zip(leaving, free))
        return ranks

    def _wait_for_min_workers(self) -> None:
        pool, need = self.pool, self.cfg.scaling.min_workers
        if len(pool) >= need:
            return
        self.run.event("waiting_for_nodes", have=len(pool), need=need, wait_s=self.cfg.failure.wait_for_nodes_s)
        deadline = time.monotonic() + self.cfg.failure.wait_for_nodes_s
        while time.monotonic() < deadline:
            pool.spawn_on_free_nodes()
            pool.await_joining(min(5.0, max(0.0, deadline - time.monotonic())), required=False)
            if len(pool) >= need:
                return
            time.sleep(0.5)
        self.budget.give_up(f"{len(pool)} workers alive, below scaling.min_workers({need}), and no nodes joined "
                            f"within failure.wait_for_nodes_s({self.cfg.failure.wait_for_nodes_s:g})")


# Where a re-plan's time goes (``goodput``), by the order's reason: (choosing and setting up, restoring).
_PLANNED = {"startup": ("startup", "startup"), "drain": ("drains", "drains"), "grow": ("resizing", "resizing"),
            "straggler": ("stragglers", "stragglers"), "recut": ("stragglers", "stragglers"),
            "quarantine": ("integrity", "integrity")}


def _buckets(order: ReplanOrder) -> tuple[str, str]:
    if order.reason in _PLANNED:
        return _PLANNED[order.reason]
    return ("replan", "restore") if order.failure is not None or order.after_failure else ("resizing", "resizing")


def _plan_summary(desc: dict | None) -> dict | None:
    if desc is None:
        return None
    return {"dp": desc["dp"], "pp": desc["pp"], "world_size": desc["world_size"],
            "stages": [s["blocks"] for s in desc["stages"]]}

"""Recovery: detect what failed, re-plan on the workers that are left, restore the last committed step.

Also growth, which is the same re-plan and restore without a loss. Survivors
keep their processes: they are told a new plan and load each of their blocks
from the best source there is (``restore``). A failure during any of it counts
as one more failure and the re-plan starts over, up to ``failure.max_failures``.

``Recovery`` reads the run's record and changes it only through the record's
operations; it sets plans up through ``PlanSetup`` and finds where to restore
from through ``RestorePoints``, both given to it. What it owns is the failure
count, the re-plan asked for, and the recovery event in progress.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import ray

from ..config import TrainerConfig
from ..errors import RunError, WorkerError
from ..planning.plan import plan_for
from ..planning.policy import choose_plan, memory_bound, no_plan_reason
from .benching import Bench
from .failures import Diagnosis, diagnose
from .fences import Fences
from .group_carry import carries_groups
from .group_settle import settle_groups
from .plan_setup import PlanSetup
from .ps_group import ParameterServers
from .restore_points import RestorePoints
from .run_record import RunRecord
from .run_state import RunState
from .snapshot_schedule import SnapshotSchedule
from .stepping import StepOutcome
from .survivor_collectives import ShrunkWorld, end_collectives, shrunk_ranks
from .workers import WorkerPool, failed

log = logging.getLogger(__name__)


class Recovery:
    def __init__(self, cfg: TrainerConfig, run: RunRecord, pool: WorkerPool, bench: Bench, setup: PlanSetup,
                 points: RestorePoints, schedule: SnapshotSchedule, ps: Callable[[], ParameterServers | None],
                 emergency: Callable[[str], str | None], fences: Fences):
        self.cfg, self.run, self.pool, self.bench, self.setup, self.points, self.schedule = (
            cfg, run, pool, bench, setup, points, schedule)
        self.fences = fences
        self._ps = ps
        self._emergency = emergency   # saves the newest committed snapshot on the way out; its path
        self.failures = 0
        self.retries_left = self.cfg.failure.retries
        self.pending_event: dict | None = None   # the recovery event, completed at the next step
        self._last_grow_check = time.monotonic()
        self._grow_wanted = False   # a larger plan waits for the next snapshot step
        self._replan_reason: str | None = None   # a re-plan asked for (a straggler benched), likewise
        self._cut: tuple | None = None           # the stage cut a re-plan asked for keeps (a re-cut)
        self._abandoned: list = []  # calls of failed steps (their parts too), read once they end (else Ray logs them)
        self.shrunk: ShrunkWorld | None = None  # the survivors' shrunk world, for the next plan to keep
        self._shrinks = 0
        self.whole: set | None = None   # the groups a failure left whole, for the next plan to carry
        self.settle_wait: dict = {}     # how the settle round's wait for survivors' steps ended

    # -- detect ----------------------------------------------------------------------------
    def recover(self, out: StepOutcome) -> None:
        """A step (or an evaluation) failed: detect, then re-plan and restore; raises ``RunError``
        past the run's limits."""
        run, pool = self.run, self.pool
        run.transition(RunState.RECOVERING, step=out.step)
        diag = diagnose(out, {w: h.actor for w, h in pool.workers.items()}, self.cfg.failure.ping_timeout_s,
                        self.cfg.failure.heartbeat_timeout_s)
        self._suspect_node_mates(diag)
        detected = time.perf_counter()
        plan_before = run.plan.describe() if run.plan else None
        self._record_failure(out.step, diag)
        # A collective that failed while every worker lived is retried first;
        # only when the retries are spent does it count as a failure.
        if diag.kind == "collective" and self.retries_left > 0:
            self.retries_left -= 1
        else:
            self.failures += 1
        # A hung worker answers pings but not its step: SIGKILLed from its node. A silent one
        # may be paused (a GC pause, a loaded host, a slow link) rather than gone: fenced out of
        # the plan, not killed, and let back in as a spare if it answers again (``fences``).
        pool.kill_hung(diag.hung)
        self._abandoned += [ref for ref in out.shard_refs.values() if ref is not None]
        # The calls still running end in errors too (a cut group, a lease refused behind this one).
        self._abandoned += list(out.inflight)
        lost_ranks = [r for r, w in run.ranks.items() if w in diag.lost]
        self.fences.fence(diag.silent)
        pool.drop(diag.dead + diag.hung)
        ps = self._ps()
        if ps:
            ps.abandon_step()
        # Where groups are carried, the settle round cuts just the groups a lost member was in,
        # which ends whatever waits on a silent peer too; else a silent loss cuts every group.
        carry = carries_groups(self.cfg) and run.plan is not None
        self._end_collectives(lost_ranks, silent=bool(diag.silent) and not carry)
        self.whole = self._settle_groups(out) if carry else set()
        self._quiesce(out)
        self._check_limits(diag)
        self.replan_and_restore(out, detected, plan_before, reason=diag.kind)

    def _suspect_node_mates(self, diag: Diagnosis) -> None:
        """A silent worker's node may be frozen whole: its other workers (one that had already
        returned its step, say) are silent too unless they answer a ping now."""
        pool = self.pool
        nodes = {pool[w].node for w in diag.silent if w in pool}
        mates = [w for w, h in pool.workers.items() if h.node in nodes and w not in diag.lost]
        if mates:
            answers = pool.ask("ping", mates, self.cfg.failure.ping_timeout_s)
            gone = [w for w, a in answers.items() if failed(a)]
            diag.silent += gone
            if gone:
                diag.detail += f"; workers {gone} on the same node answered no ping either"

    def start_failed(self, err: WorkerError) -> None:
        """A worker failed to start, or the first set-up failed (a node lost before the first
        step): one more failure, then the re-plan and restore of any recovery."""
        run, pool = self.run, self.pool
        run.transition(RunState.RECOVERING, step=run.step + 1)
        detected = time.perf_counter()
        failed_workers = getattr(err, "failed_workers", [])
        run.event("failure", failure="startup", worker=failed_workers, rank=None, node=None,
                  step=run.step + 1, detail=str(err))
        log.warning("[%s] start-up failed: %s", run.name, err)
        dead, silent = pool.dead_or_silent(list(pool.workers))
        if not dead and not silent and all(w in pool for w in failed_workers):
            # Every worker lives: the set-up raised on its own (a bug, a model that does not
            # build), which another plan would only hide. Not a loss.
            raise RunError(f"the first set-up failed on live workers (no worker or node was lost): {err}")
        self.failures += 1
        self._check_limits(Diagnosis([], [], [], "startup", str(err)))
        pool.drop(dead)
        self.fences.fence(silent)
        self.setup.abort()
        pool.spawn_on_free_nodes()   # replacements where the cluster has room; they join by growth
        self.replan_and_restore(None, detected, None, reason="startup")

    def step_committed(self) -> None:
        """A step completed: retries are back, and a recovery in progress is complete."""
        self.retries_left = self.cfg.failure.retries
        if self._abandoned:
            # A failed step's parts end in errors nobody reads; read them here, quietly.
            ready, self._abandoned = ray.wait(self._abandoned, num_returns=len(self._abandoned), timeout=0)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - the step it belonged to already failed
                    pass
        ev, self.pending_event = self.pending_event, None
        if ev is not None:
            ev["first_step_s"] = time.perf_counter() - ev.pop("_resumed")
            ev["total_s"] = ev["detect_s"] + ev["replan_s"] + ev["restore_s"] + ev["first_step_s"]
            ev["resumed_at"] = time.time()
            log.info("[%s] recovered in %.2f s (detect %.2f, re-plan %.2f, restore %.2f, first step %.2f)",
                     self.run.name, ev["total_s"], ev["detect_s"], ev["replan_s"], ev["restore_s"],
                     ev["first_step_s"])
            self.run.metrics.record_event(ev)

    def _record_failure(self, step: int, diag: Diagnosis) -> None:
        workers, run = self.pool.workers, self.run
        for kind, wids in (("death", diag.dead), ("silent", diag.silent), ("hang", diag.hung),
                           ("exception", diag.raised)):
            for w in wids:
                h = workers.get(w)
                run.event("failure", failure=kind, worker=w, rank=h.rank if h else None,
                          node=h.node if h else None, step=step, detail=diag.detail)
        if diag.kind == "collective":
            run.event("failure", failure="collective", worker=None, rank=None, node=None, step=step,
                      detail=diag.detail)
        log.warning("[%s] step %d failed (%s): %s", run.name, step, diag.kind, diag.detail)

    def _end_collectives(self, lost_ranks: list[int], silent: bool = False) -> None:
        """Survivors end the collectives they wait in (NCCL, or any backend after a silent loss;
        see ``survivor_collectives``), and the world they shrank to, if they did, is kept for the next plan."""
        run = self.run
        self._shrinks += 1
        self.shrunk = end_collectives(
            self.pool, self.cfg.scaling.resolved_backend(), run.plan.topology if run.plan else None, dict(run.ranks),
            lost_ranks, run.plan.stage_bounds if run.plan else None, self._shrinks, self.cfg.failure.rendezvous_timeout_s,
            silent=silent)

    def _settle_groups(self, out: StepOutcome) -> set:
        """gloo: the groups of the failed plan that are whole, which the survivors keep for the
        next plan to carry (``group_settle``); the rest are cut."""
        whole, self.settle_wait = settle_groups(self.pool, self.run.plan.topology, dict(self.run.ranks), out,
                                                self.cfg.failure.ping_timeout_s)
        return whole

    def _quiesce(self, out: StepOutcome) -> None:
        """Let survivors abandon the failed step: with the lost workers killed, their
        collectives fail at once; any survivor still inside one after a bound is dropped."""
        pool = self.pool
        pending = {ref: w for ref, w in out.inflight.items() if w in pool}
        if pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=self.cfg.failure.min_step_timeout_s)
            stuck = [w for ref, w in pending.items() if ref not in ready]
            if stuck:
                # Those that still answer a ping are dropped with their nodes known alive: the
                # snapshot parts they wrote there stay readable (a restore may need them).
                answers = pool.ask("ping", stuck, self.cfg.failure.ping_timeout_s)
                answered = [w for w, a in answers.items() if not failed(a)]
                self.run.event("failure", failure="hang", worker=None, rank=None, node=None, step=out.step,
                               detail=f"workers {stuck} stayed inside the failed step"
                                      + (f" ({answered} still answered a ping)" if answered else ""))
                pool.drop(answered, answered=True)
                pool.drop([w for w in stuck if w not in answered])

    def _check_limits(self, diag: Diagnosis) -> None:
        f = self.cfg.failure
        if self.failures > f.max_failures:
            path = self._emergency("the run is stopping after failures")
            raise RunError(f"stopped after {self.failures} failures (failure.max_failures={f.max_failures}); "
                           f"last: {diag.kind}: {diag.detail}" + (f"; durable checkpoint at {path}" if path else ""))

    # -- re-plan ---------------------------------------------------------------------------
    def replan_and_restore(self, out: StepOutcome | None, detected: float, plan_before: dict | None,
                           reason: str) -> None:
        """Re-plan on the live workers and restore; a failure during this counts and loops."""
        run, pool = self.run, self.pool
        attempts, retry_s = 0, 0.0
        while True:
            t0 = time.perf_counter()
            attempts += 1
            pool.await_joining(0, required=False)
            self._wait_for_min_workers()
            plan, ranks, why = self._next_plan(keep=out is not None)
            reuse = None
            kept = shrunk_ranks(self.shrunk, plan, pool) if ranks is None else None
            if kept is not None and any(w in self.bench.benched for w in kept.values()):
                kept = None   # a benched straggler holds no rank, in a shrunk world or any other
            if kept is not None:
                ranks, reuse = kept, self.shrunk.id
                why += "; the survivors keep their shrunk world (no rendezvous)"
            self.shrunk = None   # a failed attempt below leaves it in no known state
            t1 = time.perf_counter()
            restore = self.points.restore_point()
            whole, self.whole = (self.whole or set()) if out is not None else None, None
            try:
                desc = self.setup.apply(plan, restore, self.points.sources, self.points.durable_refs, ranks,
                                        reuse_world=reuse, whole=whole)
            except WorkerError as e:
                failed_workers = getattr(e, "failed_workers", [])
                run.event("failure", failure="during_recovery", worker=failed_workers, rank=None, node=None,
                          step=out.step if out else run.step + 1, detail=str(e))
                log.warning("[%s] set-up of the new plan failed: %s", run.name, e)
                self.failures += 1
                self._check_limits(Diagnosis([], [], [], "during_recovery", str(e)))
                # Drop whoever died. A live worker that failed is not at fault: it waited at
                # a rendezvous for a member that died. Abort the set-ups still waiting and let
                # them end before the next try, which would otherwise queue behind them.
                dead, silent = pool.dead_or_silent(list(pool.workers))
                pool.drop(dead)
                self.fences.fence(silent)
                self.setup.abort()
                retry_s += time.perf_counter() - t0
                continue
            t2 = time.perf_counter()
            failed_step = out.step if out else run.step + 1
            restored = restore[0] if restore else 0
            self.pending_event = run.event(
                "recovery", reason=reason, failed_step=failed_step, restored_step=restored,
                steps_redone=failed_step - restored - (0 if out else 1),
                steps_rolled_back=run.rolled_back,
                plan_before=_plan_summary(plan_before), plan_after=_plan_summary(desc), policy=why,
                sources=restore[2] if restore else {}, detect_s=detected - (out.started if out else detected),
                replan_s=t1 - detected - retry_s, restore_s=t2 - t1, attempts=attempts, failed_attempts_s=retry_s,
                _resumed=t2,
                restore_parts=dict(self.setup.setup_timings), parts_from_holders=self.points.holder_reads,
                parts_relayed=self.points.relayed_reads,
                **self.setup.restore_moved, **self.settle_wait,
                # Leases granted behind the failed one (control.renew_early), dropped before they ran.
                leases_dropped=[list(d) for d in out.dropped] if out else [],
                first_signal_at=(time.time() - (time.perf_counter() - out.first_signal)) if out and out.first_signal else None,
                detected_at=time.time() - (time.perf_counter() - detected))
            self.settle_wait = {}
            self._replan_reason = self._cut = None   # this plan already leaves every benched worker out
            self.bench.after_replan(run.step, self.setup.reset_refs)
            log.info("[%s] re-planned (%s) to dp=%d x pp=%d on %d of %d workers, restored step %d from %s",
                     run.name, reason, plan.topology.dp, plan.topology.pp, plan.topology.world_size, len(pool),
                     restored, restore[2] if restore else "the seed")
            run.transition(RunState.RUNNING)
            return

    def _next_plan(self, keep: bool) -> tuple:
        """(plan, rank -> worker id or None to place anew, why) for the workers alive now.

        With ``keep`` (after a failure) and every worker of the current plan alive, the
        plan stays as it is, each rank on its worker: nothing about the cluster changed,
        and a retry in place loads every block from the rank's own copy. A re-cut asked for
        (``request_replan(cut=...)``) likewise keeps every rank on its worker, with the new
        stage bounds. Otherwise the policy chooses, by the planner's calibrated model.
        """
        run, bench, bound = self.run, self.bench, memory_bound(self.cfg)
        usable_ids = set(bench.usable())
        intact = run.plan is not None and all(w in usable_ids for w in run.ranks.values())
        if self._cut is not None and intact and len(self._cut) == len(run.plan.stage_bounds):
            topo = run.plan.topology
            plan = plan_for(self.cfg, topo.dp, topo.pp, self._cut, run.counts)
            return plan, dict(run.ranks), f"re-cut: stages {[list(b) for b in self._cut]}, each rank on its worker"
        if keep and intact:
            topo = run.plan.topology
            plan = plan_for(self.cfg, topo.dp, topo.pp, run.plan.stage_bounds, run.counts)
            return plan, dict(run.ranks), "kept: every worker of the plan is alive"
        usable = len(usable_ids)
        choice = choose_plan(self.cfg, usable, bound)
        if (choice is None or usable < self.cfg.scaling.min_workers) and bench.benched:
            # A slow worker beats none: take the benched back before giving up or waiting.
            for ev in bench.readmit_all("no plan fits the workers that are not benched"):
                run.event(ev.pop("kind"), **ev)
            usable = len(bench.usable())
            choice = choose_plan(self.cfg, usable, bound)
        if choice is None:
            raise RunError(no_plan_reason(self.cfg, usable, bound) or f"no dp x pp fits {usable} workers")
        return plan_for(self.cfg, choice.dp, choice.pp, choice.stage_bounds, run.counts), None, choice.reason

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
        path = self._emergency("the run is stopping after failures")
        raise RunError(f"{len(pool)} workers alive, below scaling.min_workers({need}), and no nodes joined "
                       f"within failure.wait_for_nodes_s({self.cfg.failure.wait_for_nodes_s:g})"
                       + (f"; durable checkpoint at {path}" if path else ""))

    def request_replan(self, reason: str, cut: tuple | None = None) -> None:
        """Re-plan on the usable workers at the next snapshot step, as a grow does (``reason``
        names it in the recovery event). ``cut``: keep the layout and every rank on its worker,
        with these stage bounds (where every worker of the plan is still usable)."""
        self._replan_reason, self._cut = reason, cut

    def replan_pending(self) -> bool:
        """Whether a re-plan asked for (``request_replan``) is still to be taken."""
        return self._replan_reason is not None

    def quiet(self) -> bool:
        """Whether ``maybe_grow`` would do nothing now: no re-plan asked for, and none wanted
        after looking for joined workers where a look is due (a lease may then be issued
        before the last one is committed)."""
        return self._replan_reason is None and not self._grow_wanted and not self._look_for_growth()

    def _look_for_growth(self) -> bool:
        """Every ``scaling.grow_check_s``: start workers on free nodes, take in those that
        joined, and want a re-plan if the policy then prefers a larger plan; whether one is wanted."""
        now = time.monotonic()
        if now - self._last_grow_check < self.cfg.scaling.grow_check_s:
            return False
        self._last_grow_check = now
        for ev in self.fences.poll():
            self.run.event(ev.pop("kind"), **ev)
        self.pool.spawn_on_free_nodes()
        self.pool.await_joining(0, required=False)
        self._grow_wanted = self._larger_plan()
        return self._grow_wanted

    def maybe_grow(self) -> None:
        """Re-plan onto workers that joined if the policy prefers a larger plan, or as
        ``request_replan`` asked: right after a snapshot step (nothing is redone), asking the
        schedule for one if none was just taken."""
        run = self.run
        if self._replan_reason is None and not self._grow_wanted and not self._look_for_growth():
            return
        if self.schedule.last_taken != run.step:
            self.schedule.request()  # the next step takes a snapshot; re-plan from it
            return
        reason = self._replan_reason
        if reason is None:
            self._grow_wanted = False
            if not self._larger_plan():  # still: a worker may have gone meanwhile
                return
            reason = "grow"
        run.transition(RunState.RESIZING, workers=len(self.bench.usable()))
        self.replan_and_restore(None, time.perf_counter(), run.plan.describe(), reason=reason)

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


def _plan_summary(desc: dict | None) -> dict | None:
    if desc is None:
        return None
    return {"dp": desc["dp"], "pp": desc["pp"], "world_size": desc["world_size"],
            "stages": [s["blocks"] for s in desc["stages"]]}

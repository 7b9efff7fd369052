"""Recovery: detect what failed in a step, clear it away, and order the re-plan.

``recover`` classifies the failure (``failures.diagnose``), records it,
counts it against the run's limits (``FailureBudget``), kills the hung, fences
the silent, drops the dead and lets the survivors leave the failed step; what
it found the survivors can keep (a shrunk world, groups left whole) goes into
the ``ReplanOrder`` it returns. It sets nothing up: the step loop hands the
order to ``replan.Replanner``, which chooses the plan and restores. The
survivors keep their processes throughout.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import ray

from ...config import TrainerConfig
from ...errors import RunError, WorkerError
from .failure_budget import FailureBudget
from .detect import Diagnosis, diagnose
from .fences import Fences
from ..run.group_carry import carries_groups
from .group_settle import settle_groups
from .memory_kills import MemoryKills
from ..run.ps_group import ParameterServers
from ..run.orders import ReplanOrder
from ..run.run_record import RunRecord
from ..run.run_state import RunState
from ..stepping.one_step import StepOutcome
from .survivor_collectives import ShrunkWorld, end_collectives
from ..run.workers import WorkerPool

log = logging.getLogger(__name__)


class Recovery:
    def __init__(self, cfg: TrainerConfig, run: RunRecord, pool: WorkerPool, budget: FailureBudget,
                 fences: Fences, memory: MemoryKills, ps: Callable[[], ParameterServers | None]):
        self.cfg, self.run, self.pool, self.budget, self.fences = cfg, run, pool, budget, fences
        self.memory = memory
        self._ps = ps
        self._abandoned: list = []  # calls of failed steps (their parts too), read once they end (else Ray logs them)
        self._shrinks = 0
        self._failures = 0          # numbers the run's failures, for a cause found later (``memory_kills``)

    # -- detect ----------------------------------------------------------------------------
    def recover(self, out: StepOutcome) -> ReplanOrder:
        """A step (or an evaluation) failed: detect and clear it away; the re-plan it calls for.
        Raises ``RunError`` past the run's limits."""
        run, pool = self.run, self.pool
        self._failures += 1
        run.transition(RunState.RECOVERING, step=out.step)
        diag = diagnose(out, {w: h.actor for w, h in pool.workers.items()}, self.cfg.failure.ping_timeout_s,
                        self.cfg.failure.heartbeat_timeout_s)
        self._suspect_node_mates(diag)
        detected = time.perf_counter()
        plan_before = run.plan.describe() if run.plan else None
        self._record_failure(out.step, diag)
        # A collective that failed while every worker lived is retried first;
        # only when the retries are spent does it count as a failure.
        self.budget.count(retryable=diag.kind == "collective")
        # A hung worker answers pings but not its step: SIGKILLed from its node. A silent one
        # may be paused (a GC pause, a loaded host, a slow link) rather than gone: fenced out of
        # the plan, not killed, and let back in as a spare if it answers again (``fences``).
        pool.kill_hung(diag.hung)
        self._abandoned += [ref for ref in out.shard_refs.values() if ref is not None]
        # The calls still running end in errors too (a cut group, a lease refused behind this one).
        self._abandoned += list(out.inflight)
        lost_ranks = [r for r, w in run.ranks.items() if w in diag.lost]
        self.fences.fence(diag.silent, out.step, self._failures)
        # Was a death memory's? Ray's memory monitor says so in its error; else the node is asked
        # beside the re-plan (``memory_kills``).
        for ev in self.memory.found([pool[w] for w in diag.memory if w in pool], out.step, self._failures):
            run.event(ev.pop("kind"), **ev)
        self.memory.watch([pool[w] for w in diag.dead if w in pool and w not in diag.memory], out.step,
                          self._failures)
        pool.drop(diag.dead + diag.hung)
        ps = self._ps()
        if ps:
            ps.abandon_step()
        # Where groups are carried, the settle round cuts just the groups a lost member was in,
        # which ends whatever waits on a silent peer too; else a silent loss cuts every group.
        carry = carries_groups(self.cfg) and run.plan is not None
        shrunk = self._end_collectives(lost_ranks, silent=bool(diag.silent) and not carry)
        # gloo: the groups of the failed plan left whole, which the survivors keep for the next
        # plan to carry (``group_settle``); the rest are cut.
        whole, settle_wait = settle_groups(self.pool, run.plan.topology, dict(run.ranks), out,
                                           self.cfg.failure.ping_timeout_s) if carry else (set(), {})
        self._quiesce(out)
        self.budget.check(diag.kind, diag.detail)
        return ReplanOrder(diag.kind, detected, failed=out, plan_before=plan_before, shrunk=shrunk,
                           whole=whole, settle_wait=settle_wait, cause="memory" if diag.memory else None,
                           failure=self._failures)

    def _suspect_node_mates(self, diag: Diagnosis) -> None:
        """A silent worker's node may be frozen whole: its other workers (one that had already
        returned its step, say) are silent too unless they answer a ping now."""
        pool = self.pool
        nodes = {pool[w].node for w in diag.silent if w in pool}
        mates = [w for w, h in pool.workers.items() if h.node in nodes and w not in diag.lost]
        if mates:
            gone = pool.dead_among(mates)
            diag.silent += gone
            if gone:
                diag.detail += f"; workers {gone} on the same node answered no ping either"

    def lost_before_save(self) -> ReplanOrder | None:
        """After the last step, before the final save: workers of the plan that died or went
        silent since. None where the last step's state can still be saved whole without them (a
        stage with another live replica, its optimizer state not sharded): the save reads the
        survivors. Else (a sharded stage lost a slice, or a stage lost every replica) one more
        failure, cleared away as after a step, and the re-plan that restores the newest step
        every block has, for the loop to run the steps after it again."""
        run, pool = self.run, self.pool
        wids = sorted(set(run.ranks.values()))
        dead, silent = pool.dead_or_silent([w for w in wids if w in pool])
        gone = set(dead) | set(silent) | {w for w in wids if w not in pool}
        if not gone or run.plan is None:
            return None
        topo = run.plan.topology
        sharded = run.plan.shard_optimizer != "none" and topo.dp > 1
        stage_lost = any(all(run.ranks[topo.rank(d, s)] in gone for d in range(topo.dp)) for s in range(topo.pp))
        if not sharded and not stage_lost:
            return None
        self._failures += 1
        run.transition(RunState.RECOVERING, step=run.step)
        detected = time.perf_counter()
        kind = "death" if dead else "silent"
        detail = (f"workers {sorted(gone)} lost after step {run.step}, before the final save: "
                  + ("each held a slice of its stage's sharded optimizer state" if sharded
                     else "a stage has no live replica"))
        for w in sorted(gone):
            h = pool.workers.get(w)
            run.event("failure", failure="silent" if w in silent else "death", worker=w,
                      rank=h.rank if h else None, node=h.node if h else None, step=run.step, detail=detail,
                      **_drained(pool, h))
        log.warning("[%s] %s", run.name, detail)
        self.budget.count()
        self.budget.check(kind, detail)
        self.memory.watch([pool[w] for w in dead if w in pool], run.step, self._failures)
        pool.drop(dead)
        self.fences.fence(silent, run.step, self._failures)
        return ReplanOrder(kind, detected, plan_before=run.plan.describe(), failure=self._failures)

    def start_failed(self, err: WorkerError) -> ReplanOrder:
        """A worker failed to start, or the first set-up failed (a node lost before the first
        step): one more failure; the re-plan it calls for on what is left."""
        run, pool = self.run, self.pool
        self._failures += 1
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
        self.budget.count()
        self.budget.check("startup", str(err))
        self.memory.watch([pool[w] for w in dead if w in pool], run.step + 1, self._failures)
        pool.drop(dead)
        self.fences.fence(silent, run.step + 1, self._failures)
        pool.spawn_on_free_nodes()   # replacements where the cluster has room; they join by growth
        return ReplanOrder("startup", detected, abort_setups=True, failure=self._failures)

    def abandon(self, refs) -> None:
        """Calls of a step given up without a failure (an anomaly's queued lease, refused): read
        once they end, quietly."""
        self._abandoned += list(refs)

    def step_committed(self) -> None:
        """A step completed: its retries are back, and the failed steps' calls that have ended
        since are read."""
        self.budget.step_committed()
        if self._abandoned:
            # A failed step's parts end in errors nobody reads; read them here, quietly.
            ready, self._abandoned = ray.wait(self._abandoned, num_returns=len(self._abandoned), timeout=0)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - the step it belonged to already failed
                    pass

    def _record_failure(self, step: int, diag: Diagnosis) -> None:
        workers, run = self.pool.workers, self.run
        for kind, wids in (("death", diag.dead), ("silent", diag.silent), ("hang", diag.hung),
                           ("exception", diag.raised)):
            for w in wids:
                h = workers.get(w)
                run.event("failure", failure=kind, worker=w, rank=h.rank if h else None,
                          node=h.node if h else None, step=step, detail=diag.detail, **_drained(self.pool, h))
        if diag.kind == "collective":
            run.event("failure", failure="collective", worker=None, rank=None, node=None, step=step,
                      detail=diag.detail)
        log.warning("[%s] step %d failed (%s): %s", run.name, step, diag.kind, diag.detail)

    def _end_collectives(self, lost_ranks: list[int], silent: bool = False) -> ShrunkWorld | None:
        """Survivors end the collectives they wait in (NCCL, or any backend after a silent loss;
        see ``survivor_collectives``); the world they shrank to, if they did, for the next plan to keep."""
        run = self.run
        self._shrinks += 1
        return end_collectives(
            self.pool, self.cfg.scaling.resolved_backend(), run.plan.topology if run.plan else None, dict(run.ranks),
            lost_ranks, run.plan.stage_bounds if run.plan else None, self._shrinks, self.cfg.failure.rendezvous_timeout_s,
            silent=silent)

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
                gone = pool.dead_among(stuck)
                answered = [w for w in stuck if w not in gone]
                self.run.event("failure", failure="hang", worker=None, rank=None, node=None, step=out.step,
                               detail=f"workers {stuck} stayed inside the failed step"
                                      + (f" ({answered} still answered a ping)" if answered else ""))
                pool.drop(answered, answered=True)
                pool.drop([w for w in stuck if w not in answered])


def _drained(pool: WorkerPool, h) -> dict:
    """A loss on a draining node: its notice's deadline came before the run moved off it."""
    if h is None or h.node not in pool.draining:
        return {}
    return {"drain": "the node was draining: its deadline came before the run moved off it (taken as a loss)"}

"""The controller actor: one per run. Assembles the parts and runs them; owns nothing else.

This is the one module that knows every part. Each part is given what it
needs, typed narrowly, and none holds the controller:

- ``run_record.RunRecord``: the run's state (step, plan, ranks, history,
  events, identity, a stop asked for), written only through its operations;
- ``workers.WorkerPool``: starting, asking and dropping worker actors;
- ``stepping.StepDriver``: running one step on every rank, and its record;
- ``snapshots.SnapshotStore`` and ``snapshot_schedule.SnapshotSchedule``:
  snapshot bookkeeping and retention, and which steps take one;
- ``balance.Balance`` and ``benching.Bench``: pace, stragglers and what to do
  about them, handed back as values (``balance.Moves``);
- ``evaluation.Evaluator``: the held-out loss, handed back as an outcome;
- ``plan_setup.PlanSetup``: a plan set up on the workers;
- ``restore_points.RestorePoints``: where a restore reads from, and what
  ``--resume`` continues (``Resume``, applied here to the record);
- ``recovery.Recovery``: detect a failure and clear it away, handing back a
  ``replan.ReplanOrder``; ``growth.Growth``: the re-plans between steps
  (joined workers, a straggler benched, a re-cut), handed back likewise;
- ``replan.Replanner``: a re-plan order carried out (choose, set up, restore);
- ``failure_budget.FailureBudget``: the failures a run has left;
- ``memory_kills.MemoryKills``: whether a death was the kernel's OOM killer's;
- ``step_loop.StepLoop``: the loop that carries the decisions out;
- ``durable_writer.DurableWriter`` and ``saving.RunSaver``: durable
  checkpoints beside the loop, the final save and the emergency copy;
- ``queries.ControllerQueries``: what callers read while it runs.

A worker or node lost at start-up, before the first step, is a failure like
any mid-run one: the run re-plans on what is left (``Recovery.start_failed``).
Any other error first saves an emergency copy of the newest snapshot, then
fails the run with that error. A failure never restarts the survivors: they
are told a new plan and load the last committed state from the best source.
"""

from __future__ import annotations

import logging
import threading

import ray

from ..checkpoint.durable import DurableStore
from ..config import TrainerConfig
from ..errors import RunError, WorkerError
from ..logs import configure_actor_logging
from ..models.factory import block_param_counts, model_param_names
from ..naming import worker_name
from ..planning.constants import run_constants
from ..optim.build import check_patterns
from ..planning.model_shape import ModelShape, model_shape, remember_shape
from ..planning.plan import make_plan
from ..planning.policy import check_start, choose_plan, cut_fits, memory_bound
from ..secrets import install
from .balance.stragglers import Balance
from .balance.benching import Bench
from .state.durable_writer import DurableWriter
from .stepping.evaluation import Evaluator
from .failures.fences import Fences
from .integrity.anomalies import Anomalies
from .integrity.corruption import Corruption
from .replanning.first_placement import place_first
from .run.controller_faults import ControllerFaults
from .run.fault_points import FaultPoints
from .run.goodput import GoodputClock
from .run.placement import assign_ranks, fault_tolerance, pick_nodes
from .replanning.plan_setup import PlanSetup
from .run.ps_group import ParameterServers
from .queries import ControllerQueries
from .failures.failure_budget import FailureBudget
from .replanning.drains import move_seconds
from .replanning.growth import Growth
from .replanning.memory_bound import resolve_memory_bound
from .state.store_room import warn_store_short
from .failures.memory_kills import MemoryKills
from .failures.recovery import Recovery
from .replanning.replan import Replanner
from .state.restore_points import RestorePoints
from .run.run_record import RunRecord
from .run.run_state import RunState
from .state.saving import RunSaver, SaveError
from .state.snapshot_schedule import SnapshotSchedule
from .state.snapshots import SnapshotStore
from .step_loop import StepLoop
from .stepping.one_step import StepDriver
from .run.workers import WorkerPool

__all__ = ["Controller", "ControllerActor", "RunError", "RunState"]

log = logging.getLogger(__name__)

# How long the workers of a run that ended well have to leave through their own path
# (WorkerPool.teardown) before they are killed; leaving takes well under a second.
WORKERS_LEAVE_S = 15.0


class Controller:
    def __init__(self, cfg_json: dict, run_name: str, data: dict | None = None, shape: ModelShape | None = None):
        configure_actor_logging()
        cfg = self.cfg = TrainerConfig.model_validate(cfg_json)
        if shape is not None:
            remember_shape(cfg, shape)   # measured by the driver: see Trainer
        self.cfg_json = cfg_json
        self.run_name = run_name
        self.data = data or {}                 # the data fingerprint: path, rows, schema
        run = self.record = RunRecord(cfg, run_name)
        self.pool = WorkerPool(cfg, run_name)
        self.driver = StepDriver(cfg)
        self.driver.where = self._where
        ck = cfg.checkpoint
        self.snapshots = SnapshotStore(ck.replicas, ck.snapshots_kept, cfg.failure.pin_timeout_s)
        self.schedule = SnapshotSchedule(cfg)
        self.durable = DurableStore(ck.storage, run.run_id, cfg.failure.storage_retries) if ck.storage else None
        self.writer: DurableWriter | None = None    # made once the model's blocks are counted (run())
        self.ps: ParameterServers | None = None      # comm.sync: parameter_server
        ps = lambda: self.ps  # noqa: E731 - made at the first set-up, after the parts
        self.saver = RunSaver(cfg, run, self.pool, self.snapshots, self.durable, lambda: self.writer, ps)
        self.bench = Bench(cfg, run, self.pool)                         # stragglers left out as spares
        self.balance = Balance(cfg.balance, cfg.comm.sync, self._spare_plan,
                               lambda: self.setup.last_setup_s, self._cut_fits)   # per-rank pace and stragglers
        self.evaluator = Evaluator(cfg, run, self.pool, self.driver)
        self.setup = PlanSetup(cfg, run, self.pool, self.driver, self.bench, self.balance, self.snapshots,
                               self.schedule, self.evaluator, ps)
        self.points = RestorePoints(cfg, cfg_json, self.data, run, self.pool, self.snapshots, self.durable, ps)
        self.memory = MemoryKills(self.pool)
        self.fences = Fences(self.pool, cfg.failure.fence_timeout_s, self.run_name, self.memory)
        if cfg.failure.allow_fault_injection:
            # Where a fault campaign may hold the run (chaos.campaign); no other run has any.
            run.points = self.fences.points = FaultPoints()
        budget = FailureBudget(cfg, self.saver.emergency)
        self.recovery = Recovery(cfg, run, self.pool, budget, self.fences, self.memory, ps)
        self.growth = Growth(cfg, run, self.pool, self.bench, self.schedule, self.fences)
        self.growth.drains.estimate = self._move_estimate
        self.replanner = Replanner(cfg, run, self.pool, self.bench, self.setup, self.points, budget, self.fences,
                                   self.memory)
        self.corruption = Corruption(cfg, run, self.pool, self.growth.request_replan, self.driver.median_step_s)
        self.anomalies = Anomalies(cfg, run, lambda: {r: (w, self.pool[w].node if w in self.pool else None)
                                                      for r, w in run.ranks.items()}, self.corruption)
        self.replanner.on_rollback = self.anomalies.record
        self.queries = ControllerQueries(run, self.pool, self.schedule, self.balance, self.bench,
                                         lambda: dict(self.setup.setup_memory))
        self._run_called = False

    def _live_actor(self, wid):
        """The actor of worker ``wid`` while it is in the pool, else None."""
        w = self.pool.workers.get(wid) if wid is not None else None
        return w.actor if w is not None else None

    @property
    def state(self) -> RunState:
        return self.record.state

    def progress(self, since: int, events_since: int = 0, ranks_since: int | None = None) -> dict:
        """See ``ControllerQueries.progress``."""
        return self.queries.progress(since, events_since, ranks_since)

    def status(self) -> dict:
        """See ``ControllerQueries.status``."""
        return self.queries.status()

    def stop(self, reason: str = "") -> bool:
        """End the run at the next step boundary: the steps in flight complete (a step, or a lease
        and the one granted behind it), the weights and the final durable checkpoint of the last
        step are saved as at the end, and the run ends STOPPED (FINISHED if its last step was
        already done). ``reason`` goes into the ``stop_requested`` event. True when the request
        is taken; False when a stop was asked already or the run has ended.

        Any client of the cluster can call this, as it can ``ray.kill`` the actor, which saves
        nothing: of the two, this is the way that keeps the run's work."""
        return self.record.request_stop(reason)

    def worker_handles(self) -> list:
        """The actors of the live workers (for chaos tools, which inject faults into them)."""
        return [w.actor for w in self.pool.handles()]

    def inject_fault(self, kind: str, seconds: float = 0.0, step: int | None = None) -> None:
        """Chaos hooks (``run.controller_faults``); only with ``failure.allow_fault_injection``."""
        ControllerFaults(self.cfg, self.run_name, self.record, self.writer).inject(kind, seconds, step)

    def fault_point(self, op: str, point: str | None = None, occurrence: int = 1):
        """A fault campaign's hold on the run (``run.controller_faults``); only with
        ``failure.allow_fault_injection``."""
        return ControllerFaults(self.cfg, self.run_name, self.record, self.writer).point(op, point, occurrence)

    # -- the run -------------------------------------------------------------------------
    def run(self, return_model_state: bool = False, resume: bool | dict = False) -> dict:
        """The whole run, once: place, start, step, save. It ends FINISHED after the last step or
        STOPPED after ``stop()``, each with the weights (and, with storage, the final durable
        checkpoint) of its last step written and read back; any error ends it FAILED, raised.
        Any client of the cluster can call this method, so a second call is refused: running
        again would tear down the workers of the run under way."""
        run, cfg = self.record, self.cfg
        with run.lock:
            again, self._run_called = self._run_called, True
            now = run.machine.state
        if again or now is not RunState.PENDING:
            raise RunError(f"run() was already called on run {self.run_name!r} (state {now.value}): a "
                           "controller runs once; start a new run, or resume this one from its checkpoints")
        log.info("[%s] starting: dp=%d x pp=%d, %d steps", self.run_name, cfg.parallel.dp,
                 cfg.parallel.pp, cfg.train.steps)
        run.goodput = GoodputClock("startup")
        try:
            run.transition(RunState.PLACING)
            # The re-plan reads comm.constants: a missing or bad file must stop the run now,
            # not at its first node loss.
            run_constants(cfg)
            resolve_memory_bound(cfg, self.run_name)   # before the start is held to it
            run.counts = block_param_counts(cfg.model)
            if cfg.train.optimizer.param_groups:   # each group must take some of the model's parameters
                check_patterns(cfg.train.optimizer, model_param_names(cfg.model))
            if self.durable:
                self.writer = DurableWriter(self.durable, cfg, self.cfg_json, self.snapshots, len(run.counts),
                                            run.event, self.run_name, self.data, self._live_actor)
                self.writer.points = run.points
                self.writer.data_skips = lambda: list(run.data_skips)
            self.step_loop = StepLoop(cfg, run, self.pool, self.driver, self.balance, self.bench, self.snapshots,
                                      self.schedule, self.recovery, self.growth, self.replanner, self.evaluator,
                                      self.writer, lambda: self.ps, self.memory, self.anomalies, self.corruption)
            self._start(resume)
            self.step_loop.loop()
            # A worker lost after the last step whose state no survivor holds (a sharded slice, a
            # stage's every replica) is a failure like any other: re-plan, redo, then save.
            while True:
                run.points.reach("final_save", step=run.step)
                order = None if run.stopping else self.recovery.lost_before_save()
                if order is None:
                    break
                self.step_loop.replan(order)
                self.step_loop.loop()
            with run.goodput.phase("checkpointing"):
                state = self.saver.gather_state() if return_model_state else None
                saved = self.saver.final()
            run.goodput.end()
            if run.halt:   # an anomaly stopped it (integrity): saved as a stop is, and failed
                msg = (f"{run.halt}. The last good step, {run.step}, is saved: weights {saved['model_path']}"
                       + (f", durable checkpoint {saved['durable_path']}" if saved.get("durable_path") else ""))
                run.transition(RunState.FAILED, error=f"RunError: {msg}")
                raise RunError(msg)
            # A stop that came after the last step leaves nothing undone: that run finished.
            end = RunState.STOPPED if run.stopping and run.step < cfg.train.steps else RunState.FINISHED
            run.transition(end, step=run.step, model_path=saved["model_path"])
            log.info("[%s] %s at step %d of %d; weights at %s", self.run_name, end.value.lower(), run.step,
                     cfg.train.steps, saved["model_path"])
            return {"history": run.history, "events": run.events, "plan": run.plan.describe(),
                    "plans": run.plans, "workers": self.pool.table(), "run_id": run.run_id,
                    "state": end.value, "step": run.step, "goodput": run.goodput.report(),
                    "model_state": state, **saved}
        except BaseException as e:
            log.error("[%s] failed: %s: %s", self.run_name, type(e).__name__, e)
            if not run.machine.ended:  # else the error came after the end; keep it visible
                if not isinstance(e, SaveError):
                    # Whatever went wrong, the newest snapshot that survives is saved first.
                    self.saver.emergency(f"{type(e).__name__}: {e}")
                run.transition(RunState.FAILED, error=f"{type(e).__name__}: {e}")
            raise
        finally:
            run.goodput.end()
            self.growth.replacements.withdraw()
            self.replanner.flush()
            if self.ps:
                self.ps.kill()
            self.fences.clear()
            ended_well = run.machine.state in (RunState.FINISHED, RunState.STOPPED)
            self.pool.teardown(leave_s=WORKERS_LEAVE_S if ended_well else 0.0)

    def _start(self, resume: bool | dict) -> None:
        """Place and start the first workers and set up the first plan. A worker that fails to
        start, or a node lost during the set-up, is a failure: the run re-plans on what is left."""
        run, cfg = self.record, self.cfg
        plan = make_plan(cfg, run.counts)   # counted in run(); a second build for them is wasted
        check_start(cfg, plan)   # as a re-plan is held to scaling.worker_memory_gb, before any worker is placed
        # A cluster with too little room asks its autoscaler (if any) before waiting for it.
        self.growth.replacements.update(room=len(pick_nodes(cfg.scaling, cfg.max_workers, {})))
        with run.goodput.phase("waiting_for_nodes"):   # no wait where the cluster has room
            placed = place_first(cfg, plan, run.counts)
        plan, nodes = placed.plan, placed.nodes
        topo = plan.topology
        if placed.smaller:
            run.event("start_smaller", **placed.smaller)
            log.warning("[%s] room for %d of %d workers after %gs: starting on dp=%d x pp=%d, growing as nodes join",
                        self.run_name, placed.smaller["room"], placed.smaller["plan_before"]["world_size"],
                        placed.smaller["waited_s"], topo.dp, topo.pp)
        slot_of_rank = assign_ranks(topo, nodes, cfg.scaling.replica_placement)
        rank_nodes = {r: nodes[slot_of_rank[r]] for r in range(topo.world_size)}
        line = fault_tolerance(topo, rank_nodes, cfg.checkpoint.replicas)
        run.event("placement", nodes=len(set(nodes)), workers=topo.world_size, detail=line)
        log.info("[%s] placement: %s", self.run_name, line)
        short = warn_store_short(cfg, plan, rank_nodes, self.run_name)
        if short:
            run.event("object_store_short", nodes=short)
        # Worker i starts as rank i, named after it (replica, stage) for the dashboard.
        self.pool.spawn([rank_nodes[r] for r in range(topo.world_size)],
                        [worker_name(self.run_name, r, *topo.coords(r)) for r in range(topo.world_size)])
        # The re-plan after a failure reads the model's measured shape: measured now, beside the
        # workers' start, not on the recovery path (nor before the first worker was placed).
        threading.Thread(target=model_shape, args=(cfg,), name="model-shape", daemon=True).start()
        lost = self.pool.await_joining(cfg.scaling.placement_timeout_s, required=True)
        run.transition(RunState.STARTING)
        if cfg.comm.sync == "parameter_server":
            self.ps = ParameterServers(cfg, self.run_name, ray.get_runtime_context().get_node_id(), topo.dp)
            if self.writer:
                self.writer.ps = self.ps
        if resume:
            resumed = self.points.resume_source(resume)
            if resumed is not None:
                # The run continues as the run it resumes (its id, its pruning), or as a branch.
                run.adopt(resumed.run_id, resumed.history, resumed.data_skips)
                if resumed.run_id and self.durable:
                    self.durable.run_id = resumed.run_id
                self.points.resume_point = resumed.point
        try:
            if lost:
                err = WorkerError("workers failed to start: " + "; ".join(
                    f"worker {w} on node {node[:12]}: {why}" for w, node, why in lost))
                err.failed_workers = [w for w, _, _ in lost]
                raise err
            self.setup.apply(plan, self.points.resume_point, self.points.sources, self.points.durable_refs,
                             ranks={r: r for r in range(topo.world_size)})
        except WorkerError as e:
            self.step_loop.replan(self.recovery.start_failed(e))
        else:
            run.transition(RunState.RUNNING)

    def _move_estimate(self) -> float:
        """About how long moving ranks off a draining node takes now (``drains.move_seconds``)."""
        run, timing = self.record, self.setup.setup_time
        rank_bytes = timing.largest_rank_bytes(run.plan, run.counts, restoring=True) if run.plan and run.counts else 0
        return move_seconds(self.driver.median_step_s(), rank_bytes, timing.bytes_per_s)

    def _where(self, wid: int) -> tuple | None:
        """(node, pid, process mark) of a worker, for the heartbeat; None if it is not in the pool."""
        h = self.pool.workers.get(wid)
        return (h.node, h.pid, h.mark) if h is not None else None

    def _cut_fits(self, bounds) -> bool:
        topo = self.record.plan.topology
        return cut_fits(self.cfg, topo.dp, topo.pp, bounds, memory_bound(self.cfg))

    def _spare_plan(self):
        """The policy's plan on the usable workers less one (a straggler left out), or None
        where that would leave fewer than ``scaling.min_workers``."""
        n = len(self.bench.usable()) - 1
        return choose_plan(self.cfg, n, memory_bound(self.cfg)) if n >= max(1, self.cfg.scaling.min_workers) else None


class ControllerActor:
    """The run's controller as the cluster reaches it (``ray.get_actor("<run>-controller")``).

    Ray lets any driver connected to the cluster call every method of a named actor's class,
    private ones included, so the actor is this narrow class: the :class:`Controller` it holds,
    with its internals that move the run (``transition``, ``apply_plan``, ``event``, ...), is
    out of a client's reach. What is left: ``run`` (once: the driver that made the actor calls
    it), ``stop`` (ends the run STOPPED, with what it has saved), the read-only ``progress``,
    ``status``, and three chaos hooks, ``inject_fault``, ``fault_point`` and
    ``worker_handles``, refused unless the run's config sets ``failure.allow_fault_injection``.
    """

    def __init__(self, cfg_json: dict, run_name: str, data: dict | None = None, shape: ModelShape | None = None,
                 env: dict[str, str] | None = None):
        """``env``: the storage's credentials (``storage_env``), handed over here rather than in a
        runtime_env, which Ray lists to every client; set before anything reads storage."""
        install(env)
        self._ctl = Controller(cfg_json, run_name, data, shape)

    def run(self, *args, **kwargs) -> dict:
        """``Controller.run``: the whole run; a second call is refused."""
        return self._ctl.run(*args, **kwargs)

    def stop(self, reason: str = "") -> bool:
        """``Controller.stop``: end the run after the steps in flight, saved, STOPPED."""
        return self._ctl.stop(reason)

    def progress(self, since: int, events_since: int = 0, ranks_since: int | None = None) -> dict:
        """Step records, events and per-rank figures since the given indices (read-only)."""
        return self._ctl.progress(since, events_since, ranks_since)

    def status(self) -> dict:
        """What ``elastic-trainer status`` shows (read-only)."""
        return self._ctl.status()

    def inject_fault(self, *args, **kwargs) -> None:
        """``Controller.inject_fault``; only with ``failure.allow_fault_injection``."""
        return self._ctl.inject_fault(*args, **kwargs)

    def fault_point(self, op: str, point: str | None = None, occurrence: int = 1):
        """``Controller.fault_point``: a fault campaign's hold on the run; only with
        ``failure.allow_fault_injection``."""
        return self._ctl.fault_point(op, point, occurrence)

    def worker_handles(self) -> list:
        """The live workers' actors, for chaos tools that inject faults into them: only with
        ``failure.allow_fault_injection``, as those faults are."""
        if not self._ctl.cfg.failure.allow_fault_injection:
            raise PermissionError(f"worker handles are for fault injection, which is off in run "
                                  f"{self._ctl.run_name!r}: set failure.allow_fault_injection true in its config")
        return self._ctl.worker_handles()

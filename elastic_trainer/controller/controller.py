"""The controller actor: one per run. Owns the plan, the workers, the snapshots and the step loop.

It moves through the states of ``run_state`` (checked transitions); every
transition, failure and recovery is recorded with its time in ``events`` and
logged with the run's name. The rooms it composes:

- ``workers.WorkerPool``: starting, asking and dropping worker actors;
- ``stepping.StepDriver``: running one step on every rank, and its record;
- ``snapshots.SnapshotStore``: all snapshot bookkeeping and retention;
- ``recovery.Recovery``: detect, re-plan, restore (and growth);
- ``durable_writer.DurableWriter``: durable checkpoints beside the loop;
- ``saving.RunSaver``: the final checkpoint and weights, and the emergency copy.

A worker or node lost at start-up, before the first step, is a failure like
any mid-run one: the run re-plans on what is left (``Recovery.start_failed``).
Any other error first saves an emergency copy of the newest snapshot, then
fails the run with that error.

A failure never restarts the survivors: they are told a new plan
(``apply_plan``) and load the last committed state from the best source.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import ray

from ..checkpoint.durable import DurableStore
from ..config import TrainerConfig
from ..errors import RunError, WorkerError
from ..logs import configure_actor_logging
from ..metrics import RunMetrics
from ..models.factory import block_param_counts
from ..naming import worker_name
from ..planning.constants import run_constants
from ..planning.plan import Plan, make_plan
from ..planning.policy import check_start, choose_plan, cut_fits, plan_block_costs, plan_row
from .durable_writer import DurableWriter
from .balance import Balance
from .benching import Bench
from .queries import ControllerQueries
from .evaluation import Evaluator
from .group_carry import carries_groups, keep_for, plan_keys, sticky_ranks, whole_groups
from .placement import assign_ranks, fault_tolerance, find_nodes
from .ps_group import ParameterServers
from .rank_figures import RankFigures
from .recovery import Recovery
from .run_state import RunState, RunStateMachine
from .setup_report import setup_report
from .saving import RunSaver, SaveError
from .snapshot_schedule import SnapshotSchedule
from .snapshots import SnapshotStore
from .step_loop import StepLoop
from .stepping import StepDriver
from .workers import WorkerPool, get_all

__all__ = ["Controller", "RunError", "RunState"]

log = logging.getLogger(__name__)


class Controller(ControllerQueries):
    def __init__(self, cfg_json: dict, run_name: str, data: dict | None = None):
        configure_actor_logging()
        self.cfg = TrainerConfig.model_validate(cfg_json)
        self.cfg_json = cfg_json
        self.run_name = run_name
        self.run_id = uuid.uuid4().hex[:12]   # its durable checkpoints carry it; a resume adopts the stored one
        self.data = data or {}                 # the data fingerprint: path, rows, schema
        self.machine = RunStateMachine()
        self.events: list[dict] = []
        self.history: list[dict] = []
        self.rank_figures = RankFigures()     # each step's per-rank figures, kept out of its record
        self.plans: list[dict] = []
        self.plan: Plan | None = None
        self.ranks: dict[int, int] = {}       # rank -> worker id
        self.step = 0                         # last step every rank finished
        self.rolled_back = 0                  # steps after the restored one, to be run again
        self.counts: list[int] = []           # parameters per block
        self.pool = WorkerPool(self.cfg, run_name)
        self.driver = StepDriver(self.cfg)
        self.driver.where = self._where
        ck = self.cfg.checkpoint
        self.snapshots = SnapshotStore(ck.replicas, ck.snapshots_kept, self.cfg.failure.pin_timeout_s)
        self.schedule = SnapshotSchedule(self.cfg)
        self.durable = DurableStore(ck.storage, self.run_id, self.cfg.failure.storage_retries) if ck.storage else None
        self.saver = RunSaver(self)
        self.resume_point: tuple | None = None   # the durable restore of --resume, until the first set-up took it
        self.writer: DurableWriter | None = None
        self.recovery = Recovery(self)
        self.evaluator = Evaluator(self)
        self.balance = Balance(self.cfg.balance, self.cfg.comm.sync, self._spare_plan,
                               lambda: self.last_setup_s, self._cut_fits)   # per-rank pace and stragglers
        self.bench = Bench(self)                                        # stragglers left out as spares
        self.last_setup_s = 0.0   # the last plan's set-up, what balancing prices a re-plan at
        self.reset_refs: dict = {}   # worker id -> its last reset (a benched worker's probe waits for it)
        self.ps: ParameterServers | None = None      # comm.sync: parameter_server
        self.setup_timings: dict = {}
        self.restore_moved: dict = {}         # the last set-up's state transfer: bytes, seconds, rate
        self.setting_up: dict | None = None   # the plan being set up now: dp, pp, rank -> worker id
        self._setup_refs: list = []   # (worker id, ref) of the set-up calls in flight
        self._generation = 0          # numbers set-up attempts, so a stale one can be aborted
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error_at: int | None = None   # inject_fault("controller_error")
        self.metrics = RunMetrics(run_name)

    @property
    def state(self) -> RunState:
        return self.machine.state

    def stop(self, reason: str = "") -> bool:
        """End the run at the next step boundary: the steps in flight complete (a step, or a lease
        and the one granted behind it), the weights and the final durable checkpoint of the last
        step are saved as at the end, and the run ends STOPPED (FINISHED if its last step was
        already done). ``reason`` goes into the ``stop_requested`` event. True when the request
        is taken; False when a stop was asked already or the run has ended.

        Any client of the cluster can call this, as it can ``ray.kill`` the actor, which saves
        nothing: of the two, this is the way that keeps the run's work."""
        with self._lock:
            if self._stop.is_set() or self.machine.ended:
                return False
            self._stop.set()
            step = self.step
        self.event("stop_requested", step=step, reason=str(reason)[:300])
        log.warning("[%s] stop requested at step %d%s: the run ends after the steps in flight", self.run_name, step,
                    f" ({reason})" if reason else "")
        return True

    def worker_handles(self) -> list:
        """The actors of the live workers (for chaos tools, which inject faults into them)."""
        return [w.actor for w in self.pool.handles()]

    def inject_fault(self, kind: str, seconds: float = 0.0, step: int | None = None) -> None:
        """Chaos hooks: ``slow_durable`` holds each durable write ``seconds`` before it fetches its
        parts (0 ends it); ``controller_error`` raises an unexpected error in the loop before
        ``step`` (without one: before the next). Only where the config sets ``failure.allow_fault_injection``."""
        if not self.cfg.failure.allow_fault_injection:
            raise PermissionError(f"fault injection is off in run {self.run_name!r}: set "
                                  "failure.allow_fault_injection true in its config to inject faults")
        if kind == "controller_error":
            self._error_at = step or 0   # 0: the next step
            return
        if kind != "slow_durable":
            raise ValueError(f"unknown controller fault kind {kind!r}; use slow_durable or controller_error")
        if self.writer is None:
            raise ValueError("slow_durable needs checkpoint.storage: this run writes no durable checkpoints")
        self.writer.delay_s = seconds

    # -- bookkeeping -----------------------------------------------------------------
    def transition(self, new: RunState, **detail) -> tuple[RunState, RunState]:
        with self._lock:
            prev, _ = self.machine.move(new)
            self.events.append({"kind": "state", "from": prev.value, "to": new.value, "time": time.time(), **detail})
        self.metrics.set_state(new)
        log.info("[%s] %s -> %s%s", self.run_name, prev.value, new.value,
                 "".join(f" {k}={v}" for k, v in detail.items()))
        return prev, new

    def event(self, kind: str, **detail) -> dict:
        ev = {"kind": kind, "time": time.time(), **detail}
        with self._lock:
            self.events.append(ev)
        self.metrics.record_event(ev)
        return ev

    def extend_history(self, records: list[dict]) -> None:
        with self._lock:
            self.history.extend(records)

    def worker_memory(self) -> float | None:
        gb = self.cfg.scaling.worker_memory_gb
        return gb * (1 << 30) if gb else None

    # -- the run -------------------------------------------------------------------------
    def run(self, return_model_state: bool = False, resume: bool = False) -> dict:
        """The whole run, once: place, start, step, save. It ends FINISHED after the last step or
        STOPPED after ``stop()``, each with the weights (and, with storage, the final durable
        checkpoint) of its last step written and read back; any error ends it FAILED, raised.
        Any client of the cluster can call this method, so a second call is refused: running
        again would tear down the workers of the run under way."""
        with self._lock:
            again, self._run_called = getattr(self, "_run_called", False), True
            now = self.machine.state
        if again or now is not RunState.PENDING:
            raise RunError(f"run() was already called on run {self.run_name!r} (state {now.value}): a "
                           "controller runs once; start a new run, or resume this one from its checkpoints")
        log.info("[%s] starting: dp=%d x pp=%d, %d steps", self.run_name, self.cfg.parallel.dp,
                 self.cfg.parallel.pp, self.cfg.train.steps)
        try:
            self.transition(RunState.PLACING)
            # The re-plan reads comm.constants: a missing or bad file must stop the run now,
            # not at its first node loss.
            run_constants(self.cfg)
            self.counts = block_param_counts(self.cfg.model)
            if self.durable:
                self.writer = DurableWriter(self.durable, self.cfg, self.cfg_json, self.snapshots, len(self.counts),
                                            self.event, self.run_name, self.data)
            self._start(resume)
            StepLoop(self).run()
            state = self.saver.gather_state()
            saved = self.saver.final(state)
            # A stop that came after the last step leaves nothing undone: that run finished.
            end = RunState.STOPPED if self._stop.is_set() and self.step < self.cfg.train.steps else RunState.FINISHED
            self.transition(end, step=self.step, model_path=saved["model_path"])
            log.info("[%s] %s at step %d of %d; weights at %s", self.run_name, end.value.lower(), self.step,
                     self.cfg.train.steps, saved["model_path"])
            return {"history": self.history, "events": self.events, "plan": self.plan.describe(),
                    "plans": self.plans, "workers": self.pool.table(), "run_id": self.run_id,
                    "state": end.value, "step": self.step,
                    "model_state": state if return_model_state else None, **saved}
        except BaseException as e:
            log.error("[%s] failed: %s: %s", self.run_name, type(e).__name__, e)
            if not self.machine.ended:  # else the error came after the end; keep it visible
                if not isinstance(e, SaveError):
                    # Whatever went wrong, the newest snapshot that survives is saved first.
                    self.saver.emergency(f"{type(e).__name__}: {e}")
                self.transition(RunState.FAILED, error=f"{type(e).__name__}: {e}")
            raise
        finally:
            if self.ps:
                self.ps.kill()
            self.pool.teardown()

    def _start(self, resume: bool) -> None:
        """Place and start the first workers and set up the first plan. A worker that fails to
        start, or a node lost during the set-up, is a failure: the run re-plans on what is left."""
        plan = make_plan(self.cfg)
        check_start(self.cfg, plan)   # as a re-plan is held to scaling.worker_memory_gb, before any worker is placed
        topo = plan.topology
        nodes = find_nodes(self.cfg.scaling, topo.world_size, {}, self.cfg.scaling.placement_timeout_s)
        slot_of_rank = assign_ranks(topo, nodes, self.cfg.scaling.replica_placement)
        rank_nodes = {r: nodes[slot_of_rank[r]] for r in range(topo.world_size)}
        line = fault_tolerance(topo, rank_nodes, self.cfg.checkpoint.replicas)
        self.event("placement", nodes=len(set(nodes)), workers=topo.world_size, detail=line)
        log.info("[%s] placement: %s", self.run_name, line)
        # Worker i starts as rank i, named after it (replica, stage) for the dashboard.
        self.pool.spawn([rank_nodes[r] for r in range(topo.world_size)],
                        [worker_name(self.run_name, r, *topo.coords(r)) for r in range(topo.world_size)])
        lost = self.pool.await_joining(self.cfg.scaling.placement_timeout_s, required=True)
        self.transition(RunState.STARTING)
        if self.cfg.comm.sync == "parameter_server":
            self.ps = ParameterServers(self.cfg, self.run_name, ray.get_runtime_context().get_node_id(), topo.dp)
            if self.writer:
                self.writer.ps = self.ps
        self.resume_point = self.recovery.resume_source(resume) if resume else None
        try:
            if lost:
                err = WorkerError("workers failed to start: " + "; ".join(
                    f"worker {w} on node {node[:12]}: {why}" for w, node, why in lost))
                err.failed_workers = [w for w, _, _ in lost]
                raise err
            self.apply_plan(plan, self.resume_point, ranks={r: r for r in range(topo.world_size)})
        except WorkerError as e:
            self.recovery.start_failed(e)
        else:
            self.transition(RunState.RUNNING)

    def unsaved_state(self) -> dict | None:
        """The weights of a run whose final save failed, for the driver to keep."""
        return self.saver.unsaved

    def _where(self, wid: int) -> tuple | None:
        """(node, pid, process mark) of a worker, for the heartbeat; None if it is not in the pool."""
        h = self.pool.workers.get(wid)
        return (h.node, h.pid, h.mark) if h is not None else None

    # -- plans -----------------------------------------------------------------------------
    def _cfg_for(self, plan: Plan) -> dict:
        raw = self.cfg.model_dump(mode="json")
        raw["parallel"].update(dp=plan.topology.dp, pp=plan.topology.pp)
        raw["scaling"]["num_workers"] = None
        raw["scaling"]["min_workers"] = 1
        raw["scaling"]["max_workers"] = None
        return raw

    def apply_plan(self, plan: Plan, restore: tuple | None, ranks: dict[int, int] | None = None,
                   reuse_world: int | None = None, whole: set | None = None) -> dict:
        """Give every rank of ``plan`` a worker, set them up, load ``restore`` = (step, block sources, tiers).
        ``reuse_world``: the id of the survivors' shrunk world that ``ranks`` keeps (``survivor_collectives``).
        ``whole``: the last plan's groups that can be carried (``group_carry``), as a failure's
        settling found them; None asks the workers (a re-plan between steps)."""
        topo, pool = plan.topology, self.pool
        started = time.perf_counter()
        wids = self.bench.usable()   # a benched straggler holds no rank
        if len(wids) < topo.world_size:
            raise WorkerError(f"plan {topo} needs {topo.world_size} workers, {len(wids)} are alive")
        carry = reuse_world is None and carries_groups(self.cfg)
        if ranks is None and carry and self.plan is not None:
            ranks = sticky_ranks(topo, self.plan.topology, self.ranks, wids, {w: pool[w].node for w in wids})
        if ranks is None:
            slot_of_rank = assign_ranks(topo, [pool[w].node for w in wids], self.cfg.scaling.replica_placement)
            ranks = {r: wids[s] for r, s in enumerate(slot_of_rank)}
        keys = plan_keys(topo, ranks)
        if carry and whole is None and self.plan is not None:
            whole = whole_groups(pool.ask("group_state", list(ranks.values()), self.cfg.failure.ping_timeout_s))
        keep = keep_for(keys, whole if carry and whole else set())
        plan.rank_nodes = {r: pool[w].node for r, w in ranks.items()}
        sources = self.recovery.sources(restore, ranks, plan) if restore else {r: None for r in ranks}
        for w in sorted(pool.workers):   # benched ones too: they leave their groups
            if w not in ranks.values():
                pool[w].rank = None
                self.reset_refs[w] = pool[w].actor.reset.remote()
        master = pool[ranks[0]]
        timeout = self.cfg.scaling.placement_timeout_s + self.cfg.comm.timeout_s
        try:
            port = ray.get(master.actor.reserve_port.remote(), timeout=timeout)
        except (ray.exceptions.RayError, TimeoutError) as e:
            err = WorkerError(f"worker {ranks[0]} (rank 0) failed to reserve a port: {type(e).__name__}")
            err.failed_workers = [ranks[0]]
            raise err from None
        cfg_json = self._cfg_for(plan)
        coll_timeout = self.driver.collective_timeout()
        rendezvous = self.cfg.failure.rendezvous_timeout_s
        self._generation += 1
        ps = (self.ps.handles, self.ps.assignment) if self.ps else None
        refs = {r: pool[w].actor.setup.remote(
                    cfg_json, topo.dp, topo.pp, plan.stage_bounds, r, master.ip, port, sources[r],
                    coll_timeout, rendezvous, self._generation, ps, reuse_world, keys[r], keep[r])
                for r, w in ranks.items()}
        self._setup_refs = [(ranks[r], ref) for r, ref in refs.items()]
        with self._lock:
            self.setting_up = {"dp": topo.dp, "pp": topo.pp, "workers": dict(ranks)}
        try:
            outs = get_all(refs, ranks, rendezvous + 30, "set up")
        finally:
            with self._lock:
                self.setting_up = None
        self._setup_refs = []
        # Whose end of a connection each address is: a survivor's "connection closed by peer"
        # then names the lost worker at once (StepDriver._collect).
        self.driver.set_peers({ranks[r]: o.get("addresses", []) for r, o in outs.items()})
        self.setup_timings, self.restore_moved = setup_report(outs, keys)
        steps = {o["step"] for o in outs.values()}
        if len(steps) != 1:
            raise WorkerError(f"ranks restored different steps {sorted(steps)}")
        restored = steps.pop()
        if self.ps:
            # The shards go back to the step the workers restored (from their own snapshot of
            # it, or the durable shards on a resume) and expect the new number of replicas.
            self.ps.restore(restored, topo.dp, (self.recovery.durable_refs(restore[1]) if restore else None) or None)
        for r, w in ranks.items():
            pool[w].rank = r
        self.ranks = ranks
        self.plan = plan
        self.balance.new_plan(topo, self.cfg.train.global_batch_size // (topo.dp * self.cfg.train.micro_batch_size),
                              lambda: plan_row(self.cfg, topo.dp, topo.pp), plan.stage_bounds, ranks,
                              lambda: plan_block_costs(self.cfg, topo.dp), self.cfg.parallel.stages_per_rank)
        self.snapshots.set_plan(plan)
        self.snapshots.rolled_back(restored)   # later snapshots are no longer the run's state
        self.schedule.restart(restored)
        with self._lock:
            # Steps after the restored one were rolled back: they will be run again.
            self.rolled_back = self.step - restored if restore else 0
            self.history = [h for h in self.history if h["step"] <= restored]
            self.evaluator.rolled_back(restored)
            self.step = restored
        self.driver.steps_since_setup = 0
        desc = plan.describe()
        desc["workers"] = dict(ranks)
        desc["from_step"] = self.step + 1
        with self._lock:
            self.plans.append(desc)
        self.last_setup_s = time.perf_counter() - started
        return desc

    def _cut_fits(self, bounds) -> bool:
        topo = self.plan.topology
        return cut_fits(self.cfg, topo.dp, topo.pp, bounds, self.worker_memory())

    def _spare_plan(self):
        """The policy's plan on the usable workers less one (a straggler left out), or None
        where that would leave fewer than ``scaling.min_workers``."""
        n = len(self.bench.usable()) - 1
        return choose_plan(self.cfg, n, self.worker_memory()) if n >= max(1, self.cfg.scaling.min_workers) else None

    def abort_setups(self) -> None:
        """End the set-ups of a failed attempt that still wait at a rendezvous, before the next try
        (which would otherwise queue behind them on each worker's set-up lock)."""
        left = [(w, ref) for w, ref in self._setup_refs if w in self.pool]
        for w, _ in left:
            self.pool[w].actor.abort_setup.remote(self._generation)
        if left:
            ray.wait([ref for _, ref in left], num_returns=len(left), timeout=self.cfg.failure.rendezvous_timeout_s + 5)
        self._setup_refs = []

    # -- one step --------------------------------------------------------------------------
    # -- durable checkpoints -------------------------------------------------------------
    def emergency_durable(self) -> str | None:
        """On the way out after failures: save the newest committed snapshot, if any."""
        return self.saver.emergency("the run is stopping after failures")

"""Setting a plan up on the workers: a worker for every rank, the groups, the restore.

The one place a plan reaches the workers (the first plan, a recovery's, a
resize's): it gives each rank a worker, asks the survivors which groups they
hold whole, reserves the rendezvous port, calls every rank's ``setup`` with
the blocks it loads and where from, and once every rank has restored the same
step tells the parts that follow a plan (balancing, snapshots, their
schedule, evaluation, the parameter server) and the run's record. It owns
the set-up calls in flight, so a failed attempt's can be aborted before the
next one queues behind them.
"""

from __future__ import annotations

import time
from typing import Callable

import ray

from ...config import TrainerConfig
from ...errors import RunError, WorkerError
from ...planning.memory import MemoryModel
from ...planning.plan import Plan
from ...planning.policy import plan_block_costs, plan_row, plan_shard
from ..balance.stragglers import Balance
from ..balance.benching import Bench
from ..stepping.evaluation import Evaluator
from ..run.group_carry import carries_groups, keep_for, plan_keys, sticky_ranks, whole_groups
from ..run.placement import assign_ranks
from ..run.ps_group import ParameterServers
from ..run.run_record import RunRecord
from .setup_report import setup_report
from ..state.snapshot_schedule import SnapshotSchedule
from ..state.snapshots import SnapshotStore
from ..stepping.one_step import StepDriver
from .setup_time import SetupTime
from ..run.workers import WorkerPool
from ..run.asking import failed, get_all

# (restore point, rank -> worker id, plan) -> each rank's sources; durable shards' refs of a restore
Sources = Callable[[tuple, dict, Plan], dict]
DurableRefs = Callable[[dict], list]


class PlanSetup:
    def __init__(self, cfg: TrainerConfig, run: RunRecord, pool: WorkerPool, driver: StepDriver, bench: Bench,
                 balance: Balance, snapshots: SnapshotStore, schedule: SnapshotSchedule, evaluator: Evaluator,
                 ps: Callable[[], ParameterServers | None]):
        self.cfg, self.run, self.pool, self.driver = cfg, run, pool, driver
        self.bench, self.balance, self.snapshots, self.schedule, self.evaluator = (
            bench, balance, snapshots, schedule, evaluator)
        self._ps = ps
        self.reset_refs: dict = {}      # worker id -> its last reset (a benched worker's probe waits for it)
        self.setup_timings: dict = {}
        self.restore_moved: dict = {}   # the last set-up's state transfer: bytes, seconds, rate
        self.last_setup_s = 0.0         # the last plan's set-up, what balancing prices a re-plan at
        self._setup_refs: list = []     # (worker id, ref) of the set-up calls in flight
        self.setup_time = SetupTime(cfg.failure.rendezvous_timeout_s, cfg.parallel.stages_per_rank)
        self.setup_memory: dict = {}    # rank -> its memory at the last set-up (worker.memory_use)

    def _cfg_for(self, plan: Plan) -> dict:
        raw = self.cfg.model_dump(mode="json")
        raw["parallel"].update(dp=plan.topology.dp, pp=plan.topology.pp, shard_optimizer=plan.shard_optimizer)
        raw["scaling"]["num_workers"] = None
        raw["scaling"]["min_workers"] = 1
        raw["scaling"]["max_workers"] = None
        raw["data"]["skip_samples"] = [list(r) for r in self.run.data_skips]   # the config's and the run's since
        return raw

    def apply(self, plan: Plan, restore: tuple | None, sources: Sources, durable_refs: DurableRefs,
              ranks: dict[int, int] | None = None, reuse_world: int | None = None, whole: set | None = None) -> dict:
        """Give every rank of ``plan`` a worker, set them up, load ``restore`` = (step, block
        sources, tiers), each rank's refs from ``sources``. ``reuse_world``: the id of the
        survivors' shrunk world that ``ranks`` keeps (``survivor_collectives``). ``whole``: the
        last plan's groups that can be carried (``group_carry``), as a failure's settling found
        them; None asks the workers (a re-plan between steps). Raises ``WorkerError`` naming the
        workers that failed."""
        topo, pool, run = plan.topology, self.pool, self.run
        started = time.perf_counter()
        wids = self.bench.usable()   # a benched straggler holds no rank
        if len(wids) < topo.world_size:
            raise WorkerError(f"plan {topo} needs {topo.world_size} workers, {len(wids)} are alive")
        carry = reuse_world is None and carries_groups(self.cfg)
        if ranks is None and carry and run.plan is not None:
            ranks = sticky_ranks(topo, run.plan.topology, run.ranks, wids, {w: pool[w].node for w in wids})
        if ranks is None:
            slot_of_rank = assign_ranks(topo, [pool[w].node for w in wids], self.cfg.scaling.replica_placement)
            ranks = {r: wids[s] for r, s in enumerate(slot_of_rank)}
        keys = plan_keys(topo, ranks)
        if carry and whole is None and run.plan is not None:
            whole = whole_groups(pool.ask("group_state", list(ranks.values()), self.cfg.failure.ping_timeout_s))
        keep = keep_for(keys, whole if carry and whole else set())
        plan.rank_nodes = {r: pool[w].node for r, w in ranks.items()}
        per_rank = sources(restore, ranks, plan) if restore else {r: None for r in ranks}
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
        plan.shard_optimizer = plan_shard(self.cfg, plan)
        cfg_json = self._cfg_for(plan)
        coll_timeout = self.driver.collective_timeout()
        rendezvous = self.cfg.failure.rendezvous_timeout_s
        generation, timeline = run.begin_setup(restore[0] if restore else 0)
        ps = self._ps()
        ps_handles = (ps.handles, ps.assignment) if ps else None
        refs = {r: pool[w].actor.setup.remote(
                    cfg_json, topo.dp, topo.pp, plan.stage_bounds, r, master.ip, port, per_rank[r],
                    coll_timeout, rendezvous, generation, ps_handles, reuse_world, keys[r], keep[r], timeline)
                for r, w in ranks.items()}
        self._setup_refs = [(ranks[r], ref) for r, ref in refs.items()]
        run.setup_started(plan, ranks)
        run.points.reach("setup", step=run.step, workers=dict(ranks))
        if restore is not None:
            run.points.reach("restore", step=restore[0], workers=dict(ranks))
        try:
            outs = get_all(refs, ranks, self.setup_time.bound_s(plan, run.counts, restore is not None), "set up",
                           progress=self._progress)
        finally:
            run.setup_ended()
        self.setup_time.measured(outs)
        # Each rank's memory at the set-up: resident before, its peak while building, after.
        self.setup_memory = {r: o.get("memory") for r, o in sorted(outs.items())}
        self._setup_refs = []
        # Whose end of a connection each address is: a survivor's "connection closed by peer"
        # then names the lost worker at once (StepDriver._collect).
        self.driver.set_peers({ranks[r]: o.get("addresses", []) for r, o in outs.items()})
        self.setup_timings, self.restore_moved = setup_report(outs, keys)
        steps = {o["step"] for o in outs.values()}
        if len(steps) != 1:
            raise WorkerError(f"ranks restored different steps {sorted(steps)}")
        restored = steps.pop()
        check = self.restore_moved.get("restore_check")
        if check and check["differ"]:
            raise RunError(f"the state restored at step {restored} is not the state saved: {len(check['differ'])} "
                           f"of {check['tensors']} tensors differ (e.g. {', '.join(check['differ'][:3])}); "
                           "checkpoint.verify_restores stops the run rather than train on it")
        if ps:
            # The shards go back to the step the workers restored (from their own snapshot of
            # it, or the durable shards on a resume) and expect the new number of replicas.
            ps.restore(restored, topo.dp, (durable_refs(restore[1]) if restore else None) or None)
        for r, w in ranks.items():
            pool[w].rank = r
        cfg = self.cfg
        self.balance.new_plan(topo, cfg.train.global_batch_size // (topo.dp * cfg.train.micro_batch_size),
                              lambda: plan_row(cfg, topo.dp, topo.pp), plan.stage_bounds, ranks,
                              lambda: plan_block_costs(cfg, topo.dp), cfg.parallel.stages_per_rank)
        self.snapshots.set_plan(plan)
        self.snapshots.rolled_back(restored)   # later snapshots are no longer the run's state
        self.schedule.restart(restored, lambda: self._snapshot_scale(plan))
        # Steps after the restored one were rolled back: they will be run again, with their evaluations.
        self.evaluator.rolled_back(restored)
        desc = run.apply_plan(plan, ranks, restored, restoring=restore is not None or restored < run.step)
        self.driver.steps_since_setup = 0
        self.last_setup_s = time.perf_counter() - started
        return desc

    def _snapshot_scale(self, plan) -> dict | None:
        """The heaviest rank's snapshot bytes and the predicted step time of ``plan``, for
        ``memory_every: auto`` to carry its last choice over (None: unknown). Asked only when the
        schedule wants it (a choice to carry over, or one made)."""
        topo, counts = plan.topology, self.run.counts
        if not counts or not self.schedule.auto:
            return None
        stages = [sum(counts[a:b]) for a, b in plan.stage_bounds]
        heaviest = max(sum(stages[r::topo.pp]) for r in range(topo.pp))
        row = plan_row(self.cfg, topo.dp, topo.pp)
        m = MemoryModel.of(self.cfg)
        share = topo.dp if plan.shard_optimizer != "none" else 1   # sharded: each rank writes its slice
        return ({"snapshot_bytes": (m.weights + m.optimizer) * heaviest // share, "step_s": row["total_s"]}
                if row else None)

    def _progress(self, wids: list[int]) -> dict:
        """Each worker's set-up progress (``worker.setup_progress``), None where it did not answer."""
        answers = self.pool.ask("setup_progress", wids, self.cfg.failure.ping_timeout_s)
        return {w: None if failed(a) else tuple(a) for w, a in answers.items()}

    def abort(self) -> None:
        """End the set-ups of a failed attempt that still wait at a rendezvous, before the next try
        (which would otherwise queue behind them on each worker's set-up lock)."""
        left = [(w, ref) for w, ref in self._setup_refs if w in self.pool]
        for w, _ in left:
            self.pool[w].actor.abort_setup.remote(self.run.generation)
        if left:
            ray.wait([ref for _, ref in left], num_returns=len(left), timeout=self.cfg.failure.rendezvous_timeout_s + 5)
        self._setup_refs = []

"""The controller actor: one per run. Owns the plan, the workers, the snapshots and the step loop.

It moves through explicit states (``RunState``); every transition, failure
and recovery is recorded with its time in ``events``. A failure never restarts
the survivors: they are told a new plan (``setup``) and load the last
committed state from the best source there is.
"""

from __future__ import annotations

import collections
import enum
import statistics
import threading
import time
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..checkpoint.durable import CheckpointError, DurableStore
from ..checkpoint.state import shard_nbytes
from ..config import TrainerConfig
from ..errors import ElasticTrainerError, WorkerError
from ..metrics import RunMetrics
from ..models.factory import block_param_counts
from ..naming import NAMESPACE, spare_name, worker_name
from ..parallel.topology import Topology
from ..worker.actor import TrainWorker
from .failures import Diagnosis, StepOutcome, diagnose
from .placement import assign_ranks, find_nodes, free_slots
from ..planning.plan import Plan, make_plan, plan_for
from ..planning.policy import choose_plan
from .ps_group import ParameterServers
from .restore import choose_restore
from .snapshots import SnapshotStore, put_phases


class RunState(str, enum.Enum):
    PENDING = "PENDING"
    PLACING = "PLACING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    RESIZING = "RESIZING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"


@ray.remote(num_cpus=0, max_retries=0)
def _sigkill(pid: int) -> None:
    import os
    import signal

    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class RunError(ElasticTrainerError):
    """The run stopped: too many failures, or too few workers for too long."""


# After the first error of a step the others get this long to report theirs:
# ranks blocked behind a vanished peer fail within milliseconds on loopback.
_ERROR_GRACE_S = 0.3
# Queries to workers that just answered a ping (which steps they hold): a slow
# answer means a busy worker, not a lost one.
_QUERY_TIMEOUT_S = 10.0
# Steps queued on a worker at once (see worker.actor: train_step's group).
_TRAIN_CONCURRENCY = 1


@dataclass
class Slot:
    wid: int
    actor: object
    node: str
    pid: int
    ip: str
    rank: int | None = None


class Controller:
    def __init__(self, cfg_json: dict, run_name: str):
        self.cfg = TrainerConfig.model_validate(cfg_json)
        self.cfg_json = cfg_json
        self.run_name = run_name
        self.state = RunState.PENDING
        self.events: list[dict] = []
        self.history: list[dict] = []
        self.plans: list[dict] = []
        self.plan: Plan | None = None
        self.slots: dict[int, Slot] = {}
        self.joining: dict[int, tuple] = {}   # worker id -> (actor, info ref, node)
        self.ranks: dict[int, int] = {}       # rank -> worker id
        self.step = 0                         # last step every rank finished
        self.failures = 0
        self.counts: list[int] = []
        self.snapshots = SnapshotStore(self.cfg.checkpoint.replicas)
        storage = self.cfg.checkpoint.storage
        self.durable = DurableStore(storage) if storage else None
        self._durable_thread: threading.Thread | None = None
        self._durable_error: str | None = None
        self._step_times: collections.deque = collections.deque(maxlen=20)
        self._steps_since_setup = 0
        self._next_wid = 0
        self._last_grow_check = time.monotonic()
        self._pending_recovery: dict | None = None
        self._retries_left = self.cfg.failure.retries
        self.rolled_back = 0
        self._inflight: dict = {}
        self._shard_refs: dict = {}
        # Who writes which blocks of a snapshot: one {rank: blocks} per phase, taken in turn.
        self._put_phases: list[dict[int, list[int]]] = [{}]
        self._snapshots_taken = 0
        self._put_blocks: dict[int, list[int]] = {}  # this step's phase
        self.ps: ParameterServers | None = None      # comm.sync: parameter_server
        self._setup_timings: dict = {}
        self._setup_refs: list = []   # (worker id, ref) of set-up calls of failed attempts
        self._generation = 0          # numbers set-up attempts, so a stale one can be aborted
        self._durable_refs: dict = {}
        self._durable_manifest: dict = {}
        # Groups: "train" runs steps one at a time; "control" (ping, queries) never waits
        # behind the default pool, where a set-up may sit in a rendezvous for a while.
        self._actor_cls = ray.remote(
            max_concurrency=16, concurrency_groups={"train": _TRAIN_CONCURRENCY, "control": 4})(TrainWorker)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.metrics = RunMetrics(run_name)

    # -- queried while run() is in progress -------------------------------------------
    def progress(self, since: int, events_since: int = 0) -> dict:
        """Step records from index ``since`` of the history and events from ``events_since``.

        After a rollback the history is shorter than before; ``length`` tells the
        caller where it stands now.
        """
        with self._lock:
            return {"state": self.state.value, "records": self.history[since:], "length": len(self.history),
                    "events": self.events[events_since:], "n_events": len(self.events),
                    "plan": self.plan.describe() if self.plan else None}

    def status(self) -> dict:
        """What ``elastic-trainer status`` shows: plan, step, throughput, recent failures."""
        with self._lock:
            recent = self.history[-10:]
            return {"run": self.run_name, "state": self.state.value, "step": self.step,
                    "steps": self.cfg.train.steps, "last": self.history[-1] if self.history else None,
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recent) if recent else None,
                    "step_time_s": statistics.median(r["step_time_s"] for r in recent) if recent else None,
                    "plan": self.plan.describe() if self.plan else None,
                    "workers": [{"worker_id": s.wid, "rank": s.rank, "node_id": s.node, "pid": s.pid}
                                for s in self.slots.values()],
                    "failures": [e for e in self.events if e["kind"] == "failure"][-5:],
                    "recoveries": sum(1 for e in self.events if e["kind"] == "recovery")}

    def stop(self) -> None:
        """Stop at the next step boundary."""
        self._stop.set()

    # -- bookkeeping -----------------------------------------------------------------
    def _transition(self, new: RunState, **detail) -> tuple[RunState, RunState]:
        with self._lock:
            prev, self.state = self.state, new
            self.events.append({"kind": "state", "from": prev.value, "to": new.value, "time": time.time(), **detail})
        self.metrics.set_state(new)
        return prev, new

    def _event(self, kind: str, **detail) -> dict:
        ev = {"kind": kind, "time": time.time(), **detail}
        with self._lock:
            self.events.append(ev)
        self.metrics.record_event(ev)
        return ev

    # -- the run -------------------------------------------------------------------------
    def run(self, return_model_state: bool = False, resume: bool = False) -> dict:
        try:
            self._transition(RunState.PLACING)
            self.counts = block_param_counts(self.cfg.model)
            plan = make_plan(self.cfg)
            topo = plan.topology
            nodes = find_nodes(self.cfg.scaling, topo.world_size, {}, self.cfg.scaling.placement_timeout_s)
            slot_of_rank = assign_ranks(topo, nodes, self.cfg.scaling.replica_placement)
            # Worker i starts as rank i, named after it (replica, stage) for the dashboard.
            self._spawn([nodes[slot_of_rank[r]] for r in range(topo.world_size)],
                        [worker_name(self.run_name, r, *topo.coords(r))
                         for r in range(topo.world_size)])
            self._await_joining(self.cfg.scaling.placement_timeout_s, required=True)
            self._transition(RunState.STARTING)
            if self.cfg.comm.sync == "parameter_server":
                self.ps = ParameterServers(self.cfg, self.run_name, ray.get_runtime_context().get_node_id(), topo.dp)
            restore = self._resume_source() if resume else None
            self._apply_plan(plan, restore, ranks={r: r for r in range(topo.world_size)})
            self._transition(RunState.RUNNING)
            self._loop()
            self._finish_durable(final=True)
            state = self._gather_state() if return_model_state else None
            self._transition(RunState.FINISHED)
            return {"history": self.history, "events": self.events, "plan": self.plan.describe(),
                    "plans": self.plans, "workers": self._worker_table(), "model_state": state}
        except BaseException as e:
            self._transition(RunState.FAILED, error=f"{type(e).__name__}: {e}")
            raise
        finally:
            self._teardown()

    def _loop(self) -> None:
        cfg = self.cfg
        while self.step < cfg.train.steps and not self._stop.is_set():
            self._maybe_grow()
            step = self.step + 1
            outcome = self._run_step(step)
            if outcome.ok:
                self._commit_step(outcome)
            else:
                self._recover(outcome)

    # -- workers ---------------------------------------------------------------------------
    def _spawn(self, nodes: list[str], names: list[str] | None = None) -> None:
        """Start a worker on each node given (without waiting for it)."""
        res = dict(self.cfg.scaling.resources_per_worker)
        for i, node in enumerate(nodes):
            wid = self._next_wid
            self._next_wid += 1
            opts = dict(
                name=names[i] if names else spare_name(self.run_name, wid), namespace=NAMESPACE,
                num_cpus=res.get("CPU", 0), num_gpus=res.get("GPU", 0),
                resources={k: v for k, v in res.items() if k not in ("CPU", "GPU", "memory")} or None,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            )
            if "memory" in res:
                opts["memory"] = res["memory"]
            actor = self._actor_cls.options(**opts).remote(self.run_name, wid, self.cfg.scaling.torch_threads)
            self.joining[wid] = (actor, actor.info.remote(), node)

    def _await_joining(self, timeout: float, required: bool) -> None:
        """Move joined workers into slots; with ``required``, wait for all or fail."""
        if not self.joining:
            return
        refs = {info: wid for wid, (_, info, _) in self.joining.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout if required else 0)
        for ref in ready:
            wid = refs[ref]
            actor, _, node = self.joining.pop(wid)
            try:
                info = ray.get(ref)
            except ray.exceptions.RayError as e:
                if required:
                    raise WorkerError(f"worker {wid} failed to start on node {node}: {e}") from None
                continue
            self.slots[wid] = Slot(wid, actor, info["node_id"], info["pid"], info["ip"])
        if required and self.joining:
            raise WorkerError(f"{len(self.joining)} workers did not start within {timeout:g}s")

    def _worker_table(self) -> list[dict]:
        return [{"worker_id": s.wid, "rank": s.rank, "node_id": s.node, "pid": s.pid, "ip": s.ip}
                for s in self.slots.values()]

    def _drop(self, wids) -> None:
        for wid in wids:
            slot = self.slots.pop(wid, None)
            if slot is not None:
                try:
                    ray.kill(slot.actor, no_restart=True)
                except Exception:
                    pass

    # -- plans -----------------------------------------------------------------------------
    def _cfg_for(self, topo: Topology) -> dict:
        raw = self.cfg.model_dump(mode="json")
        raw["parallel"].update(dp=topo.dp, pp=topo.pp)
        raw["scaling"]["num_workers"] = None
        raw["scaling"]["min_workers"] = 1
        raw["scaling"]["max_workers"] = None
        return raw

    def _collective_timeout(self) -> float:
        """Generous until the step time is known, then a multiple of it."""
        f = self.cfg.failure
        if len(self._step_times) < f.warmup_steps:
            return self.cfg.comm.timeout_s
        tight = max(f.min_step_timeout_s, f.step_timeout_factor * statistics.median(self._step_times))
        return min(self.cfg.comm.timeout_s, tight)

    def _apply_plan(self, plan: Plan, restore: tuple | None, ranks: dict[int, int] | None = None) -> dict:
        """Give every rank of ``plan`` a worker, set them up, load ``restore`` = (step, block sources, tiers)."""
        topo = plan.topology
        wids = sorted(self.slots)
        if len(wids) < topo.world_size:
            raise WorkerError(f"plan {topo} needs {topo.world_size} workers, {len(wids)} are alive")
        if ranks is None:
            slot_nodes = [self.slots[w].node for w in wids]
            slot_of_rank = assign_ranks(topo, slot_nodes, self.cfg.scaling.replica_placement)
            ranks = {r: wids[s] for r, s in enumerate(slot_of_rank)}
        plan.rank_nodes = {r: self.slots[w].node for r, w in ranks.items()}
        blocks_of_rank = {r: plan.blocks_of(r) for r in ranks}
        sources = self._sources(restore, ranks, blocks_of_rank) if restore else {r: None for r in ranks}
        spares = [w for w in wids if w not in ranks.values()]
        for w in spares:
            self.slots[w].rank = None
            self.slots[w].actor.reset.remote()
        master_slot = self.slots[ranks[0]]
        timeout = self.cfg.scaling.placement_timeout_s + self.cfg.comm.timeout_s
        try:
            port = ray.get(master_slot.actor.reserve_port.remote(), timeout=timeout)
        except (ray.exceptions.RayError, TimeoutError) as e:
            err = WorkerError(f"worker {ranks[0]} (rank 0) failed to reserve a port: {type(e).__name__}")
            err.failed_workers = [ranks[0]]
            raise err from None
        cfg_json = self._cfg_for(topo)
        coll_timeout = self._collective_timeout()
        rendezvous = self.cfg.failure.rendezvous_timeout_s
        self._generation += 1
        ps = (self.ps.handles, self.ps.assignment) if self.ps else None
        refs = {r: self.slots[w].actor.setup.remote(
                    cfg_json, topo.dp, topo.pp, plan.stage_bounds, r, master_slot.ip, port, sources[r],
                    coll_timeout, rendezvous, self._generation, ps)
                for r, w in ranks.items()}
        self._setup_refs = [(ranks[r], ref) for r, ref in refs.items()]
        outs = self._get_all(refs, ranks, rendezvous + 30, "set up")
        self._setup_refs = []
        self._setup_timings = {k: max(o["timings"][k] for o in outs.values()) for k in ("reset", "groups", "build", "load")}
        steps = {o["step"] for o in outs.values()}
        if len(steps) != 1:
            raise WorkerError(f"ranks restored different steps {sorted(steps)}")
        restored = next(iter(steps))
        if self.ps:
            # The shards go back to the step the workers restored (from their own snapshot of
            # it, or the durable shards on a resume) and expect the new number of replicas.
            durable = [self._durable_refs[src.holder] for src in set(restore[1].values())
                       if src.tier == "durable"] if restore else []
            self.ps.restore(restored, topo.dp, durable or None)
        for r, w in ranks.items():
            self.slots[w].rank = r
        self.ranks = ranks
        self.plan = plan
        self._put_phases = self._snapshot_parts(plan)
        restored = steps.pop()
        with self._lock:
            # Steps after the restored one were rolled back: they will be run again.
            self.rolled_back = self.step - restored if restore else 0
            self.history = [h for h in self.history if h["step"] <= restored]
            self.step = restored
        self._steps_since_setup = 0
        desc = plan.describe()
        desc["workers"] = {r: w for r, w in ranks.items()}
        desc["from_step"] = self.step + 1
        with self._lock:
            self.plans.append(desc)
        return desc

    def _get_all(self, refs: dict, ranks: dict, timeout: float, what: str) -> dict:
        """Results of one call per rank. A dead worker ends the wait at once (the others
        would only time out waiting for it); failures raise a WorkerError naming them."""
        deadline = time.perf_counter() + timeout
        pending = {ref: r for r, ref in refs.items()}
        out, bad = {}, {}
        while pending and not bad:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.perf_counter()))
            if not ready:
                break
            for ref in ready:
                r = pending.pop(ref)
                try:
                    out[r] = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    cause = e.as_instanceof_cause()
                    if isinstance(cause, ElasticTrainerError):
                        raise cause from None
                    bad[ranks[r]] = cause
                except ray.exceptions.RayError as e:
                    bad[ranks[r]] = e
        if not bad:
            for r in pending.values():
                bad[ranks[r]] = TimeoutError(f"no answer in {timeout:g}s")
        if bad:
            err = WorkerError(f"workers failed to {what}: " + "; ".join(
                f"worker {w}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                for w, e in bad.items()))
            err.failed_workers = sorted(bad)
            raise err
        return out

    # -- one step --------------------------------------------------------------------------
    def _step_timeout(self) -> float:
        f = self.cfg.failure
        if self._steps_since_setup < f.warmup_steps or not self._step_times:
            return f.startup_timeout_s
        return max(f.min_step_timeout_s, f.step_timeout_factor * statistics.median(self._step_times))

    def _is_snapshot_step(self, step: int) -> bool:
        """Every ``memory_every`` steps; with local SGD / DiLoCo only where the replicas have
        just met (between meetings they differ, and a snapshot must hold one model)."""
        comm = self.cfg.comm
        meets = comm.sync not in ("local_sgd", "diloco") or step % comm.local_steps == 0
        return meets and step % self.cfg.checkpoint.memory_every == 0

    def _run_step(self, step: int) -> StepOutcome:
        snap = self._is_snapshot_step(step)
        started = time.perf_counter()
        refs, self._shard_refs = {}, {}
        self._put_blocks = self._put_phases[self._snapshots_taken % len(self._put_phases)]
        for r, w in self.ranks.items():
            metrics, shard = self.slots[w].actor.train_step.remote(step, snap, self._put_blocks[r] if snap else None)
            refs[metrics] = w
            self._shard_refs[w] = shard
        out = StepOutcome(step, started)
        deadline = started + self._step_timeout()
        pending = dict(refs)
        pings: dict = {}
        while pending:
            wait = deadline - time.perf_counter()
            if wait <= 0:
                break
            ready, _ = ray.wait(list(pending) + list(pings), num_returns=1, timeout=wait)
            for ref in ready:
                if ref in pings:
                    wid = pings.pop(ref)
                    try:
                        ray.get(ref)
                        out.answered.add(wid)
                    except Exception:
                        pass  # a dead worker's ping; its step ref will say how it died
                    continue
                wid = pending.pop(ref)
                try:
                    out.results[wid] = ray.get(ref)
                except Exception as e:  # classified by diagnose()
                    out.errors[wid] = e
                    if out.first_signal is None:
                        # Ping everyone still silent now: live ranks answer in milliseconds
                        # even while blocked in a collective; the lost ones do not.
                        out.first_signal = time.perf_counter()
                        deadline = min(deadline, out.first_signal + max(_ERROR_GRACE_S, self.cfg.failure.ping_timeout_s))
                        pings = {self.slots[w].actor.ping.remote(): w for w in pending.values()}
            if out.first_signal is not None and not pings and all(w in out.answered for w in pending.values()):
                # Every silent rank is alive: their own errors (or a peer's) arrive within
                # moments, and one of them may be the cause, so wait a little for them.
                deadline = min(deadline, time.perf_counter() + _ERROR_GRACE_S)
        out.pending = list(pending.values())
        if out.pending and out.first_signal is None:
            out.first_signal = time.perf_counter()
        self._inflight = pending
        return out

    def _commit_step(self, out: StepOutcome) -> None:
        cfg, topo, step = self.cfg, self.plan.topology, out.step
        dt = time.perf_counter() - out.started
        self._step_times.append(dt)
        self._steps_since_setup += 1
        results = list(out.results.values())
        losses = [o["loss"] for o in results if o["loss"] is not None]
        cursors = {o["cursor"] for o in results}
        if len(cursors) != 1:
            raise WorkerError(f"ranks read different data in step {step}: cursors {sorted(cursors)}")
        record = {
            "step": step, "loss": sum(losses) / len(losses), "cursor": cursors.pop(),
            "dp": topo.dp, "pp": topo.pp, "world_size": topo.world_size, "plan": len(self.plans) - 1,
            "step_time_s": dt, "tokens_per_s": cfg.train.global_batch_size * cfg.data.seq_len / dt,
            "comm_time_s": max(o["comm_time_s"] for o in results),
            "exposed_comm_s": max(o["exposed_comm_s"] for o in results),
            # The slowest rank's own time; step_time_s minus this is what driving the step costs.
            # (Queuing the next step on the workers to hide that cost measured slower on
            # oversubscribed CPU nodes: Ray's task handling then competes with the step.)
            "worker_s": max(o["compute_s"] + o["exposed_comm_s"] for o in results),
            "comm_bytes": sum(o["comm_bytes"] for o in results),
            "compression_ratio": (sum(o["dense_bytes"] for o in results) / max(1, sum(o["comm_bytes"] for o in results))
                                  if cfg.comm.sync == "allreduce" and topo.dp > 1 else None),
            "time": time.time(),
        }
        with self._lock:
            self.history.append(record)
            self.step = step
        self._retries_left = cfg.failure.retries
        if self._pending_recovery is not None:
            ev = self._pending_recovery
            ev["first_step_s"] = time.perf_counter() - ev.pop("_resumed")
            ev["total_s"] = ev["detect_s"] + ev["replan_s"] + ev["restore_s"] + ev["first_step_s"]
            ev["resumed_at"] = time.time()
            self._pending_recovery = None
            self.metrics.record_event(ev)
        self.metrics.record_step(record)
        if self._is_snapshot_step(step):
            self._take_snapshot(step, self._shard_refs, nbytes=sum(o.get("snapshot_bytes", 0) for o in results))
            self._snapshots_taken += 1
            if self.ps:
                self.ps.snapshot(step)
        self._shard_refs = {}
        for snap in self.snapshots.poll():
            # Not a result event (one per step would drown the others): a metric only.
            self.metrics.record_event({"kind": "snapshot", "step": snap.step, "bytes": snap.nbytes,
                                       "seconds": snap.committed_at - snap.started})
        self.snapshots.prune()
        if cfg.checkpoint.durable_every and step % cfg.checkpoint.durable_every == 0 and step < cfg.train.steps:
            self._start_durable(step)

    def _snapshot_parts(self, plan: Plan) -> list[dict[int, list[int]]]:
        return put_phases(plan.topology, plan.blocks_of)

    def _take_snapshot(self, step: int, shard_refs: dict, full: bool = False, nbytes: int = 0) -> None:
        """Start replicating the parts of ``step`` (worker id -> shard ref) of the current ranks;
        ``full``: each rank returned all its blocks (a snapshot off the schedule)."""
        topo = self.plan.topology
        parts, copy_nodes = {}, {}
        for r, w in self.ranks.items():
            blocks = self.plan.blocks_of(r) if full else self._put_blocks[r]
            if not blocks:
                continue
            parts[r] = (w, self.slots[w].node, shard_refs[w], blocks)
            stage = topo.coords(r)[1]
            copy_nodes[r] = {self.slots[self.ranks[topo.rank(d, stage)]].node for d in range(topo.dp)}
        workers = [(w, self.slots[w].actor, self.slots[w].node) for w in self.ranks.values()]
        self.snapshots.take(step, parts, workers, copy_nodes, nbytes)

    # -- recovery --------------------------------------------------------------------------
    def _recover(self, out: StepOutcome) -> None:
        self._transition(RunState.RECOVERING, step=out.step)
        actors = {w: s.actor for w, s in self.slots.items()}
        diag = diagnose(out, actors, self.cfg.failure.ping_timeout_s)
        detected = time.perf_counter()
        plan_before = self.plan.describe() if self.plan else None
        self._record_failure(out.step, diag)
        # A collective that failed while every worker lived is retried first;
        # only when the retries are spent does it count as a failure.
        if diag.kind == "collective" and self._retries_left > 0:
            self._retries_left -= 1
        else:
            self.failures += 1
        # A hung process does not answer Ray's polite kill for seconds; SIGKILL it from its
        # own node so its sockets close and the ranks blocked on it fail now.
        for w in diag.hung:
            if w in self.slots:
                slot = self.slots[w]
                _sigkill.options(scheduling_strategy=NodeAffinitySchedulingStrategy(slot.node, soft=False)).remote(slot.pid)
        self._drop(diag.dead + diag.hung)
        if self.ps:
            self.ps.abandon_step()
        self._quiesce(out)
        self._check_limits(diag)
        self._replan_and_restore(out, detected, plan_before, reason=diag.kind)

    def _record_failure(self, step: int, diag: Diagnosis) -> None:
        for kind, wids in (("death", diag.dead), ("hang", diag.hung), ("exception", diag.raised)):
            for w in wids:
                s = self.slots.get(w)
                self._event("failure", failure=kind, worker=w, rank=s.rank if s else None,
                            node=s.node if s else None, step=step, detail=diag.detail)
        if diag.kind == "collective":
            self._event("failure", failure="collective", worker=None, rank=None, node=None, step=step,
                        detail=diag.detail)

    def _quiesce(self, out: StepOutcome) -> None:
        """Let survivors abandon the failed step: with the lost workers killed, their
        collectives fail at once; any survivor still inside one after a bound is dropped."""
        pending = {ref: w for ref, w in self._inflight.items() if w in self.slots}
        if pending:
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=self.cfg.failure.min_step_timeout_s)
            stuck = [w for ref, w in pending.items() if ref not in ready]
            if stuck:
                self._event("failure", failure="hang", worker=None, rank=None, node=None, step=out.step,
                            detail=f"workers {stuck} stayed inside the failed step")
                self._drop(stuck)
        self._inflight = {}

    def _check_limits(self, diag: Diagnosis) -> None:
        f = self.cfg.failure
        if self.failures > f.max_failures:
            path = self._emergency_durable()
            raise RunError(f"stopped after {self.failures} failures (failure.max_failures={f.max_failures}); "
                           f"last: {diag.kind}: {diag.detail}" + (f"; durable checkpoint at {path}" if path else ""))

    def _replan_and_restore(self, out: StepOutcome | None, detected: float, plan_before: dict | None,
                            reason: str) -> None:
        """Re-plan on the live workers and restore; a failure during this counts and loops."""
        attempts, retry_s = 0, 0.0
        while True:
            t0 = time.perf_counter()
            attempts += 1
            self._await_joining(0, required=False)
            self._wait_for_min_workers()
            choice = choose_plan(self.cfg, self.counts, len(self.slots), self._worker_memory())
            if choice is None:
                raise RunError(f"no dp x pp fits {len(self.slots)} workers for global_batch_size"
                               f"({self.cfg.train.global_batch_size}) and micro_batch_size({self.cfg.train.micro_batch_size})")
            plan = plan_for(self.cfg, choice.dp, choice.pp, choice.stage_bounds, self.counts)
            t1 = time.perf_counter()
            restore = self._restore_point()
            try:
                desc = self._apply_plan(plan, restore)
            except WorkerError as e:
                failed = getattr(e, "failed_workers", [])
                self._event("failure", failure="during_recovery", worker=failed, rank=None, node=None,
                            step=out.step if out else self.step + 1, detail=str(e))
                self.failures += 1
                self._check_limits(Diagnosis([], [], [], [], "during_recovery", str(e)))
                # Drop whoever died. A live worker that failed is not at fault: it waited at
                # a rendezvous for a member that died. Abort the set-ups still waiting and let
                # them end before the next try, which would otherwise queue behind them.
                self._drop(self._dead_among(list(self.slots)))
                left = [(w, ref) for w, ref in self._setup_refs if w in self.slots]
                for w, _ in left:
                    self.slots[w].actor.abort_setup.remote(self._generation)
                if left:
                    ray.wait([ref for _, ref in left], num_returns=len(left),
                             timeout=self.cfg.failure.rendezvous_timeout_s + 5)
                self._setup_refs = []
                retry_s += time.perf_counter() - t0
                continue
            t2 = time.perf_counter()
            failed_step = out.step if out else self.step + 1
            self._pending_recovery = self._event(
                "recovery", reason=reason, failed_step=failed_step, restored_step=restore[0] if restore else 0,
                steps_redone=failed_step - (restore[0] if restore else 0) - (0 if out else 1),
                steps_rolled_back=self.rolled_back,
                plan_before=_plan_summary(plan_before), plan_after=_plan_summary(desc), policy=choice.reason,
                sources=restore[2] if restore else {}, detect_s=detected - (out.started if out else detected),
                replan_s=t1 - detected - retry_s, restore_s=t2 - t1, attempts=attempts, failed_attempts_s=retry_s,
                _resumed=t2,
                restore_parts=dict(self._setup_timings),
                first_signal_at=(time.time() - (time.perf_counter() - out.first_signal)) if out and out.first_signal else None,
                detected_at=time.time() - (time.perf_counter() - detected))
            self._transition(RunState.RUNNING)
            return

    def _failure_summary(self) -> str:
        return "; ".join(f"{e['failure']} of worker {e['worker']} at step {e['step']}"
                         + (f" ({e['detail'][:160]})" if e.get("detail") else "")
                         for e in self.events if e["kind"] == "failure") or "no failures"

    def _dead_among(self, wids) -> list[int]:
        pings = {w: self.slots[w].actor.ping.remote() for w in wids if w in self.slots}
        ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=self.cfg.failure.ping_timeout_s)
        dead = []
        for w, ref in pings.items():
            try:
                if ref not in ready:
                    raise TimeoutError
                ray.get(ref)
            except Exception:
                dead.append(w)
        return dead

    def _worker_memory(self) -> float | None:
        gb = self.cfg.scaling.worker_memory_gb
        return gb * (1 << 30) if gb else None

    def _wait_for_min_workers(self) -> None:
        need = self.cfg.scaling.min_workers
        if len(self.slots) >= need:
            return
        self._event("waiting_for_nodes", have=len(self.slots), need=need, wait_s=self.cfg.failure.wait_for_nodes_s)
        deadline = time.monotonic() + self.cfg.failure.wait_for_nodes_s
        while time.monotonic() < deadline:
            self._spawn_on_free_nodes()
            self._await_joining(min(5.0, max(0.0, deadline - time.monotonic())), required=False)
            if len(self.slots) >= need:
                return
            time.sleep(0.5)
        path = self._emergency_durable()
        raise RunError(f"{len(self.slots)} workers alive, below scaling.min_workers({need}), and no nodes joined "
                       f"within failure.wait_for_nodes_s({self.cfg.failure.wait_for_nodes_s:g})"
                       + (f"; durable checkpoint at {path}" if path else ""))

    def _restore_point(self) -> tuple[int, dict, dict] | None:
        """(step, block -> Source, where the blocks came from) for the latest step every block has."""
        live = {}
        refs = {w: s.actor.local_steps.remote() for w, s in self.slots.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=_QUERY_TIMEOUT_S)
        for w, ref in refs.items():
            if ref in ready:
                try:
                    live[w] = ray.get(ref)
                except ray.exceptions.RayError:
                    pass
        # A rank that wrote its whole state into the object store kept no other copy of it.
        for w, per_step in self.snapshots.written(set(live)).items():
            for step, (_, blocks) in per_step.items():
                live[w][step] = sorted(set(live[w].get(step, [])) | set(blocks))
        # A node counts as alive only while one of our live workers is on it: Ray's own
        # view of a node lags its death by seconds, and a shard read from a dead node blocks.
        alive_nodes = {s.node for s in self.slots.values()}
        snaps = self.snapshots.available(alive_nodes, set(self.slots))
        n_blocks = len(self.counts)
        found = choose_restore(n_blocks, live, snaps, {}, max_step=self.step)
        if found is None or (self.durable and self._durable_step_beyond(found[0])):
            durable = self._load_durable_sources()
            if durable:
                found = choose_restore(n_blocks, live, snaps, durable, max_step=self.step) or found
        if found is None:
            if self.step == 0:
                return None
            raise RunError(f"no source holds every block at any step: live copies {live}, "
                           f"snapshots {sorted(snaps)}, durable {'none' if not self.durable else 'unusable'}; "
                           f"after: {self._failure_summary()}")
        step, chosen = found
        tiers = collections.Counter(src.tier for src in chosen.values())
        return step, chosen, dict(tiers)

    def _durable_step_beyond(self, step: int) -> bool:
        steps = self.durable.steps() if self.durable else []
        return bool(steps) and steps[0] > step

    def _load_durable_sources(self) -> dict:
        try:
            loaded = self.durable.load_latest() if self.durable else None
        except CheckpointError as e:
            self._event("checkpoint_problem", detail=str(e))
            return {}
        if not loaded:
            return {}
        shards, manifest, problems = loaded
        for p in problems:
            self._event("checkpoint_problem", detail=p)
        self._durable_refs = {i: ray.put(s) for i, s in enumerate(shards)}
        self._durable_manifest = manifest
        return {manifest["step"]: {i: s["blocks"] for i, s in enumerate(shards)}}

    def _sources(self, restore: tuple, ranks: dict[int, int], blocks_of_rank: dict[int, list[int]]) -> dict:
        """Per rank, what to load: its own local copy, other workers' exports, snapshot or durable refs."""
        step, chosen, _ = restore
        own = {}
        refs = {w: self.slots[w].actor.local_steps.remote() for w in ranks.values()}
        for w, ref in refs.items():
            try:
                own[w] = ray.get(ref, timeout=_QUERY_TIMEOUT_S).get(step, [])
            except Exception:
                own[w] = []
        # Parts written by live workers at this step: their objects are those workers' copies.
        written = {w: per[step] for w, per in self.snapshots.written(set(self.slots)).items() if step in per}
        out = {}
        for r, w in ranks.items():
            need = set(blocks_of_rank[r])
            srcs: list = []
            mine = need & set(own.get(w, []))
            if mine:
                srcs.append(("local", step))
                need -= mine
            if w in written and need & set(written[w][1]):
                srcs.append(written[w][0])
                need -= set(written[w][1])
            by_src: dict = collections.defaultdict(set)
            for b in need:
                by_src[chosen[b]].add(b)
            for src, blocks in by_src.items():
                if src.tier == "live" and src.holder in written and blocks <= set(written[src.holder][1]):
                    srcs.append(written[src.holder][0])
                elif src.tier == "live":
                    srcs.append(self.slots[src.holder].actor.export_blocks.remote(step, sorted(blocks)))
                elif src.tier == "snapshot":
                    srcs.append(self.snapshots.ref(step, src.holder))
                else:
                    srcs.append(self._durable_refs[src.holder])
            out[r] = srcs
        return out

    def _resume_source(self) -> tuple | None:
        if not self.durable:
            raise RunError("resume needs checkpoint.storage")
        durable = self._load_durable_sources()
        if not durable:
            self._event("resume", detail=f"no checkpoint in {self.cfg.checkpoint.storage}; starting fresh")
            return None
        found = choose_restore(len(self.counts), {}, {}, durable)
        if found is None:
            raise RunError(f"the checkpoint in {self.cfg.checkpoint.storage} does not cover every block of this model")
        history = self._durable_manifest.get("history", [])
        with self._lock:
            self.history.extend(history)
        self._event("resume", step=found[0], source=self.cfg.checkpoint.storage)
        return found[0], found[1], {"durable": len(found[1])}

    # -- growth ----------------------------------------------------------------------------
    def _spawn_on_free_nodes(self) -> None:
        want = self.cfg.max_workers - len(self.slots) - len(self.joining)
        if want <= 0:
            return
        occupied = collections.Counter(s.node for s in self.slots.values())
        occupied.update(node for _, _, node in self.joining.values())
        free = free_slots(self.cfg.scaling, occupied)
        nodes = [n for n in sorted(free) for _ in range(free[n])][:want]
        if nodes:
            self._spawn(nodes)

    def _maybe_grow(self) -> None:
        now = time.monotonic()
        if now - self._last_grow_check < self.cfg.scaling.grow_check_s:
            return
        self._last_grow_check = now
        self._spawn_on_free_nodes()
        self._await_joining(0, required=False)
        spares = [w for w, s in self.slots.items() if s.rank is None]
        if not spares or self.step % self.cfg.checkpoint.memory_every:
            return
        choice = choose_plan(self.cfg, self.counts, len(self.slots), self._worker_memory())
        topo = self.plan.topology
        if choice is None or (choice.dp, choice.pp) == (topo.dp, topo.pp) or choice.world_size <= topo.world_size:
            return
        self._transition(RunState.RESIZING, workers=len(self.slots))
        plan_before = self.plan.describe()
        self._replan_and_restore(None, time.perf_counter(), plan_before, reason="grow")

    # -- durable checkpoints -------------------------------------------------------------
    def _durable_shards(self, step: int) -> list:
        """Refs of snapshot parts of ``step`` covering every block (the parameter-server
        shards' in that mode: they hold the optimizer state, the workers do not)."""
        if self.ps:
            return self.ps.shards(step) or []
        return self.snapshots.covering(step, len(self.counts)) or []

    def _start_durable(self, step: int) -> None:
        if self._durable_thread is not None and self._durable_thread.is_alive():
            return  # the previous write is still going; skip rather than queue
        refs = self._durable_shards(step)
        if not refs:
            return
        history = list(self.history)
        self._durable_thread = threading.Thread(target=self._write_durable, args=(step, refs, history), daemon=True)
        self._durable_thread.start()

    def _write_durable(self, step: int, refs: list, history: list) -> str | None:
        t0 = time.perf_counter()
        try:
            shards = ray.get(refs, timeout=self.cfg.comm.timeout_s)
            path = self.durable.save(step, shards, {"history": history, "config": self.cfg_json,
                                                     "plan": self.plan.describe()})
            self.durable.prune(self.cfg.checkpoint.keep_durable)
        except Exception as e:
            self._durable_error = f"{type(e).__name__}: {e}"
            self._event("checkpoint_problem", detail=f"durable checkpoint of step {step} failed: {self._durable_error}")
            return None
        self._event("durable_checkpoint", step=step, path=path, seconds=time.perf_counter() - t0,
                    bytes=sum(shard_nbytes(s) for s in shards))
        return path

    def _finish_durable(self, final: bool) -> str | None:
        if self._durable_thread is not None:
            self._durable_thread.join()
        if not (self.durable and final):
            return None
        if not self._is_snapshot_step(self.step):
            # The last step has no snapshot: take one so the end is saved exactly.
            self._take_snapshot(self.step, {w: self.slots[w].actor.export_snapshot.remote(self.step)
                                            for w in self.ranks.values()}, full=True)
            if self.ps:
                self.ps.snapshot(self.step)
        return self._write_durable(self.step, self._durable_shards(self.step), list(self.history))

    def _emergency_durable(self) -> str | None:
        """On the way out after failures: save the newest committed snapshot, if any."""
        if not self.durable:
            return None
        if self._durable_thread is not None:
            self._durable_thread.join()
        alive = {s.node for s in self.slots.values()}
        for step in reversed(self.snapshots.committed_steps()):
            pick = self.ps.shards(step) if self.ps else self.snapshots.covering(
                step, len(self.counts), alive, set(self.slots))
            if pick:
                history = [h for h in self.history if h["step"] <= step]
                return self._write_durable(step, pick, history)
        return None

    # -- the end ------------------------------------------------------------------------
    def _gather_state(self) -> dict:
        """Full model state from replica 0's ranks (every replica holds the same weights)."""
        topo = self.plan.topology
        refs = [self.slots[self.ranks[topo.rank(0, s)]].actor.state_dict.remote() for s in range(topo.pp)]
        out = {}
        for part in ray.get(refs, timeout=self.cfg.comm.timeout_s):
            out.update(part)
        return out

    def _teardown(self) -> None:
        if self.ps:
            self.ps.kill()
        for slot in list(self.slots.values()):
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:
                pass
        for actor, _, _ in self.joining.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.slots, self.joining = {}, {}


def _plan_summary(desc: dict | None) -> dict | None:
    if desc is None:
        return None
    return {"dp": desc["dp"], "pp": desc["pp"], "world_size": desc["world_size"],
            "stages": [s["blocks"] for s in desc["stages"]]}

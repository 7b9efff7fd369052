"""The Ray actor hosting one rank.

It is a threaded actor (max_concurrency > 1) so that its control methods
(``ping``, snapshots, ``reset``) answer while the training thread is inside a
step or blocked in a collective. The actor outlives re-plans: ``setup`` can be
called again with another rank and layout, and the local copies of recent
states survive it (they are the "live replica" tier of recovery).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import traceback
from typing import TYPE_CHECKING

import ray
import torch

from ..checkpoint.flat import ShardExporter
from ..checkpoint.host_arena import HostArena
from ..config import TrainerConfig
from ..errors import error_line
from ..logs import configure_actor_logging
from ..secrets import install
from ..parallel.topology import Topology
from .device import bind, current_visible, worker_device
from .faults import FaultHooks
from .integrity_faults import KINDS as INTEGRITY_KINDS
from .group_address import bind_groups_to
from .group_control import GroupControl
from .group_keeper import GroupKeeper
from .lease_order import LeaseOrder
from .memory_use import cuda_peak_bytes, peak_rss_bytes, reset_peaks, rss_bytes
from .node_fate import watch_raylet
from .restore_fetch import fetch_sources
from .setup_progress import PROGRESS
from .weights_writer import write_stage
from .snapshot_serving import SnapshotServing
from .step_calls import StepCalls
from .worker_questions import WorkerQuestions

if TYPE_CHECKING:
    # Imported by the worker itself (``_stage_trainer``): torch.distributed.pipelining takes about
    # 1 s to import, and the controller, which imports this module for the actor class, need not.
    from .stage import StageTrainer

log = logging.getLogger(__name__)


def _build_key(cfg: TrainerConfig, device) -> tuple:
    """What decides how a block is built and wrapped: blocks built alike can be reused."""
    t = cfg.train
    return (cfg.model.model_dump_json(), t.precision, t.activation_checkpointing, str(device))


# The parts of a set-up, timed in order (its answer's ``timings``).
SETUP_PARTS = ("reset", "groups", "build", "fetch", "load")



class TrainWorker(StepCalls, SnapshotServing, GroupControl, WorkerQuestions):
    def __init__(self, run_name: str, worker_id: int, torch_threads: int | None, allow_faults: bool = False,
                 host_budget: int | None = None, env: dict[str, str] | None = None):
        """``host_budget``: bytes this worker's snapshot copy buffers may hold (its share of
        ``checkpoint.host_memory_gb`` on its node; None: no bound). ``env``: the secret-valued
        environment variables (credentials, secret-named ``scaling.env_vars``), handed over here
        rather than in the runtime_env Ray lists; set before anything reads storage."""
        install(env)
        configure_actor_logging()
        self.run_name = run_name
        self.worker_id = worker_id
        self.rank: int | None = None
        if torch_threads is not None and not torch.cuda.is_available():
            torch.set_num_threads(torch_threads)
        # The GPU Ray gave this worker, bound before anything touches CUDA (see worker.device).
        self.gpu = worker_device(ray.get_gpu_ids(), current_visible(), torch.cuda.is_available())
        bind(self.gpu)
        self.trainer: StageTrainer | None = None
        # Imported now, while the worker waits for its plan, not in its set-up. Without the cycle
        # collector: an import makes objects and frees none, and its passes cost a quarter of the
        # 1.3 s of CPU this import takes (torch.distributed.pipelining, dynamo and DTensor in it).
        gc.disable()
        try:
            _stage_trainer()
        finally:
            gc.enable()
        self._init_snapshots()
        self._host_budget = host_budget
        self._exporter: ShardExporter | None = None   # made at the first set-up, kept for the worker's life
        # failure.allow_fault_injection gates every hook
        self.faults = FaultHooks(allow_faults, f"run {run_name!r} (worker {worker_id})")
        # torch.distributed's default group is process-wide: one set-up at a time. A set-up
        # left waiting at a rendezvous with a dead member holds this until its timeout.
        self._setup_lock = threading.Lock()
        self._aborted_upto = 0  # set-ups of this generation and older are abandoned
        self._done_step = 0   # the last step completed (train_lease's progress, for a failure)
        self._busy = 0        # steps, leases and evaluations running now
        # One step or lease at a time; the train group's second thread holds a lease granted
        # behind the running one, waiting for it (``lease_order``).
        self._train_lock = threading.Lock()
        self._lease_order = LeaseOrder(f"worker {worker_id}")
        # When this rank's last step or evaluation call ended; None after a set-up or a failure
        # (a lease's ``gap_s`` is then not what waiting for the controller cost).
        self._idle_since: float | None = None
        self._step_thread: int | None = None   # the thread steps run on (what ``group_state`` reads)
        self._hold_on_failure = True   # failure.keep_groups of the current plan
        self._build_key = None
        self._kept = None   # (build key, blocks, device) of the last stage, until the next set-up
        self.groups = GroupKeeper(f"[{run_name}] worker {worker_id}")
        # A worker ends with its node (node_fate).
        self._raylet_watch = watch_raylet(f"[{run_name}] worker {worker_id}")
        # Groups bind to the interface of Ray's address for this node, not the host name's.
        self._group_iface = bind_groups_to(ray.util.get_node_ip_address())
        # Everything imported so far lives as long as the process: keep it out of
        # the collections that reset() runs on the recovery path (80 ms each otherwise).
        gc.freeze()

    @ray.method(concurrency_group="storage")
    def write_durable_part(self, store_spec: tuple, step: int, index: int, shard: dict) -> dict:
        """Write ``shard`` (a snapshot part this worker made: its object is on this node) as part
        ``index`` of the durable checkpoint of ``step`` and read it back (``DurableStore.write_part``);
        its manifest entry. Beside steps, on a thread of its own."""
        from ..checkpoint.durable import write_part_here

        return write_part_here(store_spec, step, index, shard)

    @ray.method(concurrency_group="storage")
    def write_weights(self, job: dict) -> dict:
        """Write this rank's stage as its part of the final weights (``weights_writer.write_stage``)."""
        return write_stage(self.trainer.state_dict(), job, ray.get_runtime_context().get_node_id())

    @ray.method(concurrency_group="control")
    def abort_setup(self, generation: int) -> None:
        """Abandon set-ups of ``generation`` and older that still wait for other ranks."""
        self._aborted_upto = max(self._aborted_upto, generation)

    def setup(self, cfg_json: dict, dp: int, pp: int, stage_bounds: list[tuple[int, int]], rank: int,
              master_addr: str, master_port: int, sources: list | None = None,
              collective_timeout_s: float | None = None, rendezvous_timeout_s: float | None = None,
              generation: int = 0, ps: tuple | None = None, reuse_world: int | None = None,
              group_keys: dict | None = None, keep: list[str] | None = None, timeline: list | None = None) -> dict:
        """Join the process groups of a plan as ``rank`` and build its stage(s).

        ``sources``: object refs (nested in a list, so Ray does not resolve them
        on the way in) of shards from one step covering this rank's blocks, or
        None to start from the seed. ``generation`` numbers the controller's
        attempts, so ``abort_setup`` can end this one without touching a later one.
        ``ps``: (shard handles, parameter -> shard) in parameter-server mode. ``reuse_world``:
        the id of a shrink (``abort_comms``) whose world this plan keeps, instead of a rendezvous.
        ``group_keys``: role (``dp``, ``pp``) -> the worker ids of this rank's group in the plan;
        ``keep``: the roles whose group of the last plan has those members and is carried.
        ``timeline``: ``(generation, restored step)`` of the run's set-ups, this one's last: local
        copies of a timeline it abandoned are let go and never restored (``copies.on_timeline``).
        """
        bind(self.gpu)  # CUDA's current device is per thread, and Ray's calls come on several
        with self._setup_lock:
            try:
                return self._setup(cfg_json, dp, pp, stage_bounds, rank, master_addr, master_port, sources,
                                   collective_timeout_s, rendezvous_timeout_s, generation, ps, reuse_world,
                                   group_keys or {}, keep or [], timeline)
            except BaseException as e:
                log.warning("[%s] worker %d: set-up as rank %d of dp=%d x pp=%d failed: %s", self.run_name,
                            self.worker_id, rank, dp, pp, error_line(e))
                traceback.clear_frames(e.__traceback__)
                self._reset()
                raise

    def _setup(self, cfg_json, dp, pp, stage_bounds, rank, master_addr, master_port, sources,
               collective_timeout_s, rendezvous_timeout_s, generation, ps, reuse_world, group_keys, keep,
               timeline=None) -> dict:
        t = [time.perf_counter()]
        PROGRESS.begin()
        cfg = TrainerConfig.model_validate(cfg_json)
        peak_device = self.gpu if cfg.scaling.uses_gpu else torch.device("cpu")
        idle_rss = rss_bytes()
        reset_peaks(peak_device)
        self._hold_on_failure = cfg.failure.keep_groups
        self._reset(keep={role: group_keys[role] for role in keep if role in group_keys})
        held = self._held_blocks(cfg) if sources else None
        self._kept = None  # not reused: let it go before building
        delay = self.faults.setup_delay()
        if delay:
            time.sleep(delay)
        self._configure_snapshots(cfg, generation, timeline)
        topo = Topology(dp, pp)
        device = self.gpu if cfg.scaling.uses_gpu else torch.device("cpu")
        t.append(time.perf_counter())

        def aborted() -> bool:   # the controller gave this set-up up (abort_setup)
            return self._aborted_upto >= generation > 0

        groups, joined, carried = self.groups.join(cfg.scaling.resolved_backend(), master_addr, master_port, topo,
                                                   rank, collective_timeout_s or cfg.comm.timeout_s,
                                                   rendezvous_timeout_s, aborted, device, reuse_world, group_keys)
        t.append(time.perf_counter())
        trainer = _stage_trainer()(cfg, topo, rank, groups, stage_bounds, device, ps=ps, restoring=bool(sources),
                                   held=held, exporter=self._snapshot_exporter(device))
        del held
        t.append(time.perf_counter())
        # Built first: a sharded rank's owned ranges say what of the parts it reads it needs.
        shards, moved = (fetch_sources(sources, self.copies, aborted, self.worker_id, trainer.restore_want())
                         if sources else ([], {"bytes": 0, "seconds": 0.0, "regather": 0, "local_generations": []}))
        t.append(time.perf_counter())
        step, fingerprints = 0, None
        if sources:
            mine = set(trainer.blocks)
            shards = [s for s in shards if mine & set(s["blocks"])]
            step = trainer.load(shards)
            if cfg.checkpoint.verify_restores:
                fingerprints = trainer.restore_fingerprints(shards)
        del shards
        t.append(time.perf_counter())
        self._build_key = _build_key(cfg, device)
        trainer.clock.slow_factor = self.faults.slow_factor(rank)
        if self.faults.integrity is not None:
            self.faults.integrity.bind(rank, at_start=not sources)
        trainer.faults = trainer.inputs.faults = self.faults.integrity
        self.trainer, self.rank = trainer, rank
        log.info("[%s] worker %d: rank %d of dp=%d x pp=%d, blocks %s, at step %d (%s)", self.run_name,
                 self.worker_id, rank, dp, pp, trainer.blocks, step, "restored" if sources else "from the seed")
        memory = {"idle_rss_bytes": idle_rss, "setup_peak_rss_bytes": peak_rss_bytes(), "rss_bytes": rss_bytes(),
                  "setup_peak_device_bytes": cuda_peak_bytes(peak_device)}
        reset_peaks(peak_device)   # from here, each step's peak
        return {"rank": rank, "stages": trainer.stage_ids, "blocks": trainer.blocks, "step": step, "memory": memory,
                "params": sum(p.numel() for p in trainer.params), "device": str(device),
                "world": joined, "carried": carried, "group_parts": dict(self.groups.join_timings),
                "timings": dict(zip(SETUP_PARTS, (b - a for a, b in zip(t, t[1:])))),
                "moved": moved, "build": trainer.build_info, "addresses": self.groups.addresses(),
                "fingerprints": fingerprints}

    def _snapshot_exporter(self, device: torch.device) -> ShardExporter:
        """The worker's snapshot copy buffers: one arena within its budget, reused by every plan."""
        if self._exporter is None:
            label = f"[{self.run_name}] worker {self.worker_id}"
            self._exporter = ShardExporter(HostArena(self._host_budget, pinned=device.type == "cuda", label=label))
            log.info("%s: snapshot copy buffers within %s (its share of checkpoint.host_memory_gb)", label,
                     "no bound" if self._host_budget is None else f"{self._host_budget / (1 << 30):.2f} GiB")
        return self._exporter

    def _held_blocks(self, cfg: TrainerConfig):
        """The blocks of the last stage (kept by ``reset``), to reuse in the next if built alike."""
        kept, self._kept = self._kept, None
        if kept is None or kept[0] != _build_key(cfg, kept[2]):
            return None
        return kept[1]

    def reset(self, keep: dict | None = None, hold: bool = False) -> None:
        """Leave the process groups and drop the stage; keep local copies. Ordered with set-ups
        (it takes their lock): a reset sent before a set-up never runs beside it, where it would
        tear down the groups that set-up just joined. ``_reset`` has the arguments."""
        with self._setup_lock:
            self._reset(keep, hold)

    @ray.method(concurrency_group="control")
    def leave(self) -> None:
        """End this worker at a run's end through its own path: leave the process groups, drop the
        stage and its threads, then exit the actor (the caller sees it die, ``RayActorError``).
        A kill ends the process wherever its threads are, and one still there when the driver
        ends its local cluster is sent SIGTERM: Ray's handler raises SystemExit wherever it
        lands, and "Exception ignored ... SystemExit" reaches the driver's last lines."""
        with self._setup_lock:
            self._reset()
        ray.actor.exit_actor()

    def _reset(self, keep: dict | None = None, hold: bool = False) -> None:
        """Leave the process groups and drop the stage; keep local copies.

        gloo closes a group's sockets only when the last reference to it goes,
        so the stage (schedule, pipeline stages, averager) is dropped and
        collected first. Peers blocked on this rank then fail at once instead
        of waiting out their collective timeout. ``keep``: role -> key of the
        groups the next plan carries (``GroupKeeper.leave``). ``hold``: after a
        failed step, leave the groups as they are for the controller to settle.
        """
        had_stage = self.trainer is not None
        self._idle_since = None
        self._forget_snapshots()
        if had_stage:
            self.trainer.close()
            # The blocks outlive the stage: a restore into the next plan reuses those it keeps.
            self._kept = (self._build_key, self.trainer.release_blocks(), self.trainer.device)
        self.trainer = None
        self.rank = None
        if had_stage:
            gc.collect()  # the stage's reference cycles hold the groups
        if hold:
            self.groups.hold()
        else:
            self.groups.leave(keep)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.trainer.state_dict()

    # -- fault injection, for chaos tests and demos --------------------------------
    def inject_fault(self, kind: str, step: int | None = None, seconds: float = 0.0, **spec) -> None:
        """Chaos hooks: ``raise`` an exception inside ``step`` (without one: the next step), or
        ``raise_eval`` inside the evaluation after it; hold the next ``setup``
        for ``seconds``; hold pinning the snapshot of ``step`` for ``seconds``; make every
        snapshot hold its step ``seconds`` longer (``slow_snapshot``; 0 ends it); make this
        worker's compute ``seconds`` times slower (``slow_compute``, a straggler; 1 ends it;
        with a step, that step alone); grow past this worker's memory limit in ``step`` until the
        kernel kills it (``grow_memory``: a memory kill; refused without a limit).
        ``slow_pin`` without a step holds every pin. The integrity faults ``nan``, ``poison`` and
        ``flip`` (``worker.integrity_faults``; ``spec``: their other fields) hit the rank this worker
        is now unless ``spec`` names one. Only where the run's config sets
        ``failure.allow_fault_injection``."""
        if kind in INTEGRITY_KINDS:
            self.faults.check_allowed()
            self.faults.integrity.add({"kind": kind, "step": step, "rank": self.rank, **spec})
            return
        self.faults.inject(kind, step, seconds)
        if kind == "slow_compute" and self.trainer is not None:
            self.trainer.clock.slow_factor = self.faults.slow


def _stage_trainer():
    from .stage import StageTrainer
    return StageTrainer

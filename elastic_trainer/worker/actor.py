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
import os
import socket
import threading
import time
import traceback

import ray
import torch

from ..checkpoint.state import select_blocks, shard_nbytes
from ..config import TrainerConfig
from ..logs import configure_actor_logging
from ..parallel.topology import Topology
from .copies import HeldCopies
from .process_group import destroy_groups, free_port, init_groups
from .stage import StageTrainer

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised by a step that a test asked to fail."""


class TrainWorker:
    def __init__(self, run_name: str, worker_id: int, torch_threads: int | None):
        configure_actor_logging()
        self.run_name = run_name
        self.worker_id = worker_id
        self.rank: int | None = None
        if torch_threads is not None and not torch.cuda.is_available():
            torch.set_num_threads(torch_threads)
        self.trainer: StageTrainer | None = None
        self.copies = HeldCopies()
        self._faults: dict = {}
        # torch.distributed's default group is process-wide: one set-up at a time. A set-up
        # left waiting at a rendezvous with a dead member holds this until its timeout.
        self._setup_lock = threading.Lock()
        self._aborted_upto = 0  # set-ups of this generation and older are abandoned
        # Everything imported so far lives as long as the process: keep it out of
        # the collections that reset() runs on the recovery path (80 ms each otherwise).
        gc.freeze()

    @ray.method(concurrency_group="control")
    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "worker_id": self.worker_id,
            "pid": os.getpid(),
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "gpu_ids": ray.get_gpu_ids(),
        }

    @ray.method(concurrency_group="control")
    def reserve_port(self) -> int:
        return free_port()

    @ray.method(concurrency_group="control")
    def ping(self) -> bool:
        return True

    @ray.method(concurrency_group="control")
    def abort_setup(self, generation: int) -> None:
        """Abandon set-ups of ``generation`` and older that still wait for other ranks."""
        self._aborted_upto = max(self._aborted_upto, generation)

    def setup(self, cfg_json: dict, dp: int, pp: int, stage_bounds: list[tuple[int, int]], rank: int,
              master_addr: str, master_port: int, sources: list | None = None,
              collective_timeout_s: float | None = None, rendezvous_timeout_s: float | None = None,
              generation: int = 0, ps: tuple | None = None) -> dict:
        """Join the process groups of a plan as ``rank`` and build its stage(s).

        ``sources``: object refs (nested in a list, so Ray does not resolve them
        on the way in) of shards from one step covering this rank's blocks, or
        None to start from the seed. ``generation`` numbers the controller's
        attempts, so ``abort_setup`` can end this one without touching a later one.
        ``ps``: (shard handles, parameter -> shard) in parameter-server mode.
        """
        with self._setup_lock:
            try:
                return self._setup(cfg_json, dp, pp, stage_bounds, rank, master_addr, master_port, sources,
                                   collective_timeout_s, rendezvous_timeout_s, generation, ps)
            except BaseException as e:
                log.warning("[%s] worker %d: set-up as rank %d of dp=%d x pp=%d failed: %s: %s", self.run_name,
                            self.worker_id, rank, dp, pp, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
                traceback.clear_frames(e.__traceback__)
                self.reset()
                raise

    def _setup(self, cfg_json, dp, pp, stage_bounds, rank, master_addr, master_port, sources,
               collective_timeout_s, rendezvous_timeout_s, generation, ps) -> dict:
        t = [time.perf_counter()]
        self.reset()
        delay = self._faults.pop("setup", None)
        if delay:
            time.sleep(delay)
        cfg = TrainerConfig.model_validate(cfg_json)
        self.copies.keep = cfg.checkpoint.snapshots_kept
        topo = Topology(dp, pp)
        device = torch.device("cuda", 0) if cfg.scaling.uses_gpu and torch.cuda.is_available() else torch.device("cpu")
        t.append(time.perf_counter())
        groups = init_groups(cfg.scaling.resolved_backend(), master_addr, master_port, topo, rank,
                             collective_timeout_s or cfg.comm.timeout_s, rendezvous_timeout_s,
                             aborted=lambda: self._aborted_upto >= generation > 0)
        t.append(time.perf_counter())
        trainer = StageTrainer(cfg, topo, rank, groups, stage_bounds, device, ps=ps)
        t.append(time.perf_counter())
        step = 0
        if sources:
            mine = set(trainer.blocks)
            shards = [self._shard(s) for s in sources]
            step = trainer.load([s for s in shards if mine & set(s["blocks"])])
        t.append(time.perf_counter())
        self.trainer, self.rank = trainer, rank
        log.info("[%s] worker %d: rank %d of dp=%d x pp=%d, blocks %s, at step %d (%s)", self.run_name,
                 self.worker_id, rank, dp, pp, trainer.blocks, step, "restored" if sources else "from the seed")
        return {"rank": rank, "stages": trainer.stage_ids, "blocks": trainer.blocks, "step": step,
                "params": sum(p.numel() for p in trainer.params), "device": str(device),
                "timings": dict(zip(("reset", "groups", "build", "load"), (b - a for a, b in zip(t, t[1:]))))}

    def _shard(self, source) -> dict:
        if isinstance(source, tuple) and source[0] == "local":
            return self.copies.local_copy(source[1])
        return ray.get(source)

    def reset(self) -> None:
        """Leave the process groups and drop the stage; keep local copies.

        gloo closes a group's sockets only when the last reference to it goes,
        so the stage (schedule, pipeline stages, averager) is dropped and
        collected first. Peers blocked on this rank then fail at once instead
        of waiting out their collective timeout.
        """
        had_stage = self.trainer is not None
        if had_stage:
            self.trainer.close()
        self.trainer = None
        self.rank = None
        if had_stage:
            gc.collect()  # the stage's reference cycles hold the groups
        destroy_groups()

    @ray.method(concurrency_group="train", num_returns=2)
    def train_step(self, step: int, snapshot: bool, put_blocks: list[int] | None = None) -> tuple[dict, dict | None]:
        """Run ``step``. With ``snapshot``, keep a local copy of this rank's state after it,
        and return the part holding ``put_blocks`` (all of it if None; None if empty) as
        the second result: returned, not put, so the caller (the controller) owns the object.
        A rank that writes all its blocks keeps no other copy: the returned object is it."""
        try:
            if self._faults.pop(("raise", step), None):
                raise InjectedFault(f"injected fault in step {step} on worker {self.worker_id}")
            r = self.trainer.train_step(step)
        except BaseException as e:
            log.warning("[%s] worker %d: step %d failed on rank %s: %s: %s", self.run_name, self.worker_id, step,
                        self.rank, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            # Abandon the step: the traceback's frames hold the stage and its
            # groups, so clear them before leaving the groups (see reset()).
            traceback.clear_frames(e.__traceback__)
            self.reset()
            raise
        shard = None
        if snapshot:
            writes_all = put_blocks is not None and set(put_blocks) >= set(self.trainer.blocks)
            shard = self.trainer.live_part(step) if writes_all else None
            # A rank that writes its whole state has the object store copy it straight from
            # the live tensors as the step returns, and that object, on this node, serves as
            # this step's local copy (the controller knows it): one copy instead of two.
            if shard is None:
                # What a snapshot costs the step: one local copy (and its write into the object store).
                shard = self.trainer.export(step)
                self.copies.add_local(step, shard)
                if put_blocks is not None:
                    shard = select_blocks(shard, put_blocks) if put_blocks else None
        return ({"rank": self.rank, "loss": r.loss, "compute_s": r.compute_s, "comm_time_s": r.comm_s,
                 "exposed_comm_s": r.exposed_comm_s, "comm_bytes": r.comm_bytes, "dense_bytes": r.dense_bytes,
                 "cursor": r.cursor, "loss_scale": r.loss_scale, "skipped": r.skipped,
                 "snapshot_bytes": shard_nbytes(shard) if shard else 0}, shard)

    # -- snapshots and restore sources --------------------------------------------
    @ray.method(concurrency_group="control")
    def local_steps(self) -> dict[int, list[int]]:
        """Steps this worker holds a local copy of, with the blocks each covers."""
        return self.copies.local_blocks()

    def export_snapshot(self, step: int) -> dict:
        """A local copy of the current state as ``step`` (for a final snapshot off the schedule)."""
        shard = self.trainer.export(step)
        self.copies.add_local(step, shard)
        return shard

    def export_blocks(self, step: int, blocks: list[int]) -> dict:
        """The part of the local copy at ``step`` that holds ``blocks``."""
        return select_blocks(self.copies.local_copy(step), blocks)

    def pin(self, key: tuple, refs: list, keep_from: int) -> int:
        """Hold a copy of another rank's shard on this node so it outlives that node.

        ``keep_from``: the oldest step the controller still keeps; copies of older
        steps are let go here, which spares it an unpin call per shard per step."""
        delay = self._faults.get(("pin", key[0]))
        if delay:
            time.sleep(delay)
        return self.copies.pin(key, ray.get(refs[0]), keep_from)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.trainer.state_dict()

    # -- fault injection, for chaos tests and demos --------------------------------
    def inject_fault(self, kind: str, step: int | None = None, seconds: float = 0.0) -> None:
        """Chaos hooks: ``raise`` an exception inside ``step``; hold the next ``setup``
        for ``seconds``; hold pinning the snapshot of ``step`` for ``seconds``."""
        if kind == "raise":
            self._faults[("raise", step)] = True
        elif kind == "slow_setup":
            self._faults["setup"] = seconds
        elif kind == "slow_pin":
            self._faults[("pin", step)] = seconds
        else:
            raise ValueError(f"unknown fault kind {kind!r}; use raise, slow_setup or slow_pin")

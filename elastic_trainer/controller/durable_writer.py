"""Durable checkpoints of committed snapshots, written beside the step loop.

A durable checkpoint is made from a committed object-store snapshot (or, in
parameter-server mode, the shards' own snapshot), so writing it never stalls
a step: a thread fetches the parts and writes them while training goes on.
At most one write runs at a time; a due write that finds the previous one
still going is skipped rather than queued.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import ray

from ..checkpoint.durable import DurableStore
from ..checkpoint.state import shard_nbytes
from ..config import TrainerConfig
from .snapshots import SnapshotStore

log = logging.getLogger(__name__)


class DurableWriter:
    """Writes snapshots of a run into its ``DurableStore`` and reports each write as an event."""

    def __init__(self, store: DurableStore, cfg: TrainerConfig, cfg_json: dict, snapshots: SnapshotStore,
                 n_blocks: int, event: Callable[..., dict], run_name: str, data: dict | None = None):
        self.store, self.cfg, self.cfg_json = store, cfg, cfg_json
        self.data = data or {}   # the data fingerprint (path, rows, schema) the manifest records
        self.snapshots, self.n_blocks, self._event, self.run_name = snapshots, n_blocks, event, run_name
        self.ps = None  # the run's ParameterServers, in that mode: they hold the optimizer state
        self.delay_s = 0.0  # a chaos hook (Controller.inject_fault): each write holds this long first
        self._thread: threading.Thread | None = None

    def shards(self, step: int, alive_nodes: set[str] | None = None, alive_workers: set[int] | None = None) -> list:
        """Refs of snapshot parts of ``step`` covering every block (the parameter-server shards'
        in that mode); only parts with a surviving copy when ``alive_*`` are given; [] if none."""
        if self.ps:
            return self.ps.shards(step) or []
        return self.snapshots.covering(step, self.n_blocks, alive_nodes, alive_workers) or []

    def start(self, step: int, history: list, plan: dict) -> None:
        """Write ``step`` in the background, unless the previous write is still going."""
        if self._thread is not None and self._thread.is_alive():
            return
        refs = self.shards(step)
        if not refs:
            return
        self._thread = threading.Thread(target=self.write, args=(step, refs, history, plan), daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the background write, if any, has ended."""
        if self._thread is not None:
            self._thread.join()

    def write(self, step: int, refs: list, history: list, plan: dict, raise_errors: bool = False) -> str | None:
        """Fetch ``refs`` and write them as the checkpoint of ``step``; the path, or None on failure
        (reported as an event; ``raise_errors``: raised as well)."""
        t0 = time.perf_counter()
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            shards = ray.get(refs, timeout=self.cfg.comm.timeout_s)
            path = self.store.save(step, shards, {"history": history, "config": self.cfg_json, "plan": plan,
                                                  "run_name": self.run_name, "data": self.data})
            self.store.prune(self.cfg.checkpoint.keep_durable)
        except Exception as e:  # noqa: BLE001 - reported as an event; the run goes on from memory
            error = f"{type(e).__name__}: {e}"
            log.error("[%s] durable checkpoint of step %d failed: %s", self.run_name, step, error)
            self._event("checkpoint_problem", detail=f"durable checkpoint of step {step} failed: {error}")
            if raise_errors:
                raise
            return None
        seconds = time.perf_counter() - t0
        log.info("[%s] durable checkpoint of step %d at %s (%.2f s)", self.run_name, step, path, seconds)
        self._event("durable_checkpoint", step=step, path=path, seconds=seconds,
                    bytes=sum(shard_nbytes(s) for s in shards))
        return path

    def emergency(self, alive_nodes: set[str], alive_workers: set[int], history: list, plan: dict) -> str | None:
        """On the way out after failures: write the newest committed snapshot that survives, if any."""
        self.wait()
        for step in reversed(self.snapshots.committed_steps()):
            pick = self.shards(step, alive_nodes, alive_workers)
            if pick:
                return self.write(step, pick, [h for h in history if h["step"] <= step], plan)
        return None

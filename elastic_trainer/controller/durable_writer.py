"""Durable checkpoints of committed snapshots, written beside the step loop.

A durable checkpoint is made from a committed object-store snapshot (or, in
parameter-server mode, the shards' own snapshot), so writing it never stalls
a step: a thread fetches the parts and writes them while training goes on.
At most one write runs at a time; a due write that finds the previous one
still going is skipped rather than queued.

A write that fails is told the moment the writer sees it (on the write's own
thread, for a periodic one): a ``durable_failed`` event (step, storage, error,
the newest step written, and its role: periodic, final or emergency), which
the driver prints as a line (and a metric can count), and a log record. A
periodic write's failure is only a warning: the run goes on from its
in-memory snapshots, and the next due write tries again; the final one's
fails the run (``saving``).
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
        self.last_written: int | None = None   # the newest step this writer has written
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

    def write(self, step: int, refs: list, history: list, plan: dict, raise_errors: bool = False,
              role: str = "periodic") -> str | None:
        """Fetch ``refs`` and write them as the checkpoint of ``step`` (see :meth:`save`)."""
        t0 = time.perf_counter()
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            shards = ray.get(refs, timeout=self.cfg.comm.timeout_s)
        except Exception as e:  # noqa: BLE001 - reported; the run goes on from memory
            self._failed(step, e, "final" if raise_errors else role)
            if raise_errors:
                raise
            return None
        return self.save(step, shards, history, plan, raise_errors, role, started=t0)

    def save(self, step: int, shards: list[dict], history: list, plan: dict, raise_errors: bool = False,
             role: str = "periodic", started: float | None = None) -> str | None:
        """Write ``shards`` (parts covering every block) as the checkpoint of ``step``, then prune
        the run's older ones; the path, or None on failure. A failure is reported at once, as a
        ``durable_failed`` event and a warning; ``raise_errors`` (the final checkpoint, whose
        failure fails the run): raised as well. ``role``: periodic, final or emergency."""
        t0 = time.perf_counter() if started is None else started
        try:
            path = self.store.save(step, shards, {"history": history, "config": self.cfg_json, "plan": plan,
                                                  "run_name": self.run_name, "data": self.data})
            self.store.prune(self.cfg.checkpoint.keep_durable)
        except Exception as e:  # noqa: BLE001 - reported; the run goes on from memory
            self._failed(step, e, "final" if raise_errors else role)
            if raise_errors:
                raise
            return None
        self.last_written = step
        seconds = time.perf_counter() - t0
        log.info("[%s] durable checkpoint of step %d at %s (%.2f s)", self.run_name, step, path, seconds)
        self._event("durable_checkpoint", step=step, path=path, seconds=seconds,
                    bytes=sum(shard_nbytes(s) for s in shards))
        return path

    def _failed(self, step: int, e: Exception, role: str) -> None:
        error = f"{type(e).__name__}: {e}"
        if role == "periodic":
            kept = f"the newest on storage is of step {self.last_written}" if self.last_written is not None \
                else "none written since the run started"
            log.warning("[%s] durable checkpoint of step %d failed; the run goes on from memory (%s): %s",
                        self.run_name, step, kept, error)
        else:
            log.error("[%s] %s durable checkpoint of step %d failed: %s", self.run_name, role, step, error)
        self._event("durable_failed", step=step, role=role, storage=self.store.uri, error=error,
                    last_written=self.last_written)

    def emergency(self, alive_nodes: set[str], alive_workers: set[int], history: list, plan: dict) -> str | None:
        """On the way out after failures: write the newest committed snapshot that survives, if any."""
        self.wait()
        for step in reversed(self.snapshots.committed_steps()):
            pick = self.shards(step, alive_nodes, alive_workers)
            if pick:
                return self.write(step, pick, [h for h in history if h["step"] <= step], plan, role="emergency")
        return None

"""Durable checkpoints of committed snapshots, written beside the step loop.

A durable checkpoint is made from a committed object-store snapshot (or, in
parameter-server mode, the shards' own snapshot), so writing it never stalls
a step: a thread has each part written by a task on its node, in parallel
(``durable_parts``), and writes the manifest once all are, while training goes
on. The controller holds refs, never a part.
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


from ...checkpoint.durable import DurableStore
from ...checkpoint.history_log import HistoryLog
from ...config import TrainerConfig
from ..run.fault_points import NO_POINTS
from .durable_parts import PART_TIMEOUT_S, DurableParts
from .snapshots import SnapshotStore

log = logging.getLogger(__name__)


class DurableWriter:
    """Writes snapshots of a run into its ``DurableStore`` and reports each write as an event."""

    def __init__(self, store: DurableStore, cfg: TrainerConfig, cfg_json: dict, snapshots: SnapshotStore,
                 n_blocks: int, event: Callable[..., dict], run_name: str, data: dict | None = None,
                 actor_of: Callable[[int | None], object] = lambda wid: None):
        self.store, self.cfg, self.cfg_json = store, cfg, cfg_json
        self.data = data or {}   # the data fingerprint (path, rows, schema) the manifest records
        self.data_skips = lambda: []   # the run's sample ranges never read (RunRecord.data_skips), recorded too
        self.snapshots, self.n_blocks, self._event, self.run_name = snapshots, n_blocks, event, run_name
        self.ps = None  # the run's ParameterServers, in that mode: they hold the optimizer state
        self.delay_s = 0.0  # a chaos hook (Controller.inject_fault): each write holds this long first
        self.last_written: int | None = None   # the newest step this writer has written
        self._thread: threading.Thread | None = None
        self.parts = DurableParts(store, max(PART_TIMEOUT_S, cfg.comm.timeout_s))
        # The steps' records go beside the checkpoints, each write adding those since the last.
        self.history = HistoryLog(store)
        self.actor_of = actor_of   # worker id -> its live actor (None: gone), which writes its own parts
        self.points = NO_POINTS    # a fault campaign's (controller.run.fault_points)

    def shards(self, step: int, alive_nodes: set[str] | None = None, alive_workers: set[int] | None = None) -> list:
        """(ref, node, writer) of snapshot parts of ``step`` covering every block (the
        parameter-server shards' in that mode, on no node and by no worker); only parts with a
        surviving copy when ``alive_*`` are given; [] if none. The writer is the live worker
        actor that made the part, else None (a task on its node writes it)."""
        if self.ps:
            return [(ref, None, None) for ref in self.ps.shards(step) or []]
        parts = self.snapshots.covering(step, self.n_blocks, alive_nodes, alive_workers, with_nodes=True) or []
        return [(ref, node, self.actor_of(wid)) for ref, node, wid, *_ in parts]

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

    def write(self, step: int, parts: list, history: list, plan: dict, raise_errors: bool = False,
              role: str = "periodic") -> str | None:
        """Write ``parts`` ((ref, node) covering every block) as the checkpoint of ``step``, each
        on its node, then the manifest, then prune the run's older ones; the path, or None on
        failure. A failure is reported at once, as a ``durable_failed`` event and a warning;
        ``raise_errors`` (the final checkpoint, whose failure fails the run): raised as well.
        ``role``: periodic, final or emergency."""
        t0 = time.perf_counter()
        try:
            if self.delay_s:
                time.sleep(self.delay_s)
            files = self.parts.write(step, parts)
            self.points.reach("durable_write", step=step, role="final" if raise_errors else role)
            seq = self.history.write(step, history)
            path = self.store.commit(step, files, {"history_seq": seq, "config": self.cfg_json, "plan": plan,
                                                   "run_name": self.run_name, "data": self.data,
                                                   "data_skips": [list(r) for r in self.data_skips()]},
                                     n_blocks=self.n_blocks)
            self.store.prune(self.cfg.checkpoint.keep_durable)
        except Exception as e:  # noqa: BLE001 - reported; the run goes on from memory
            self._failed(step, e, "final" if raise_errors else role)
            if raise_errors:
                raise
            return None
        self.last_written = step
        seconds = time.perf_counter() - t0
        log.info("[%s] durable checkpoint of step %d at %s (%.2f s, %d parts)", self.run_name, step, path, seconds,
                 len(files))
        self._event("durable_checkpoint", step=step, path=path, seconds=seconds,
                    bytes=sum(f["bytes"] for f in files),
                    parts=[{"name": f["name"], "bytes": f["bytes"], "seconds": round(f["seconds"], 3),
                            "node": f.get("node")} for f in files])
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

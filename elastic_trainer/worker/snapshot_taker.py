"""Snapshots off the critical path: the copy overlaps the next step, and the update that would overwrite it waits.

A snapshot of step N must hold the state after N's optimizer update. The
next step's forward and backward only read parameters and AdamW moments (they
write gradients), so the copy can run beside them; only the next update (or a
parameter-server pull, or a restore) writes the state, and that waits for what
is still in flight (``SnapshotTaker.wait``). Two ways to take it:

- copy: a thread copies the state into flat buffers that are reused
  (``checkpoint.flat.ShardExporter``); on a GPU, device-to-host on a side
  stream that first waits for an event recorded on the compute stream, into
  pinned buffers. The copy becomes the local copy and, where the rank writes
  some blocks, the object-store part.
- lend: a rank that writes its whole state into the object store lends the
  live CPU tensors (``checkpoint.tensor_loan.TensorLoan``): Ray's own write into the object
  store, on the actor's snapshot thread, is then the only copy.

One snapshot is in flight at a time, so the extra host memory is one copy of
the rank's state (the buffer being filled; lent views cost nothing). The
error-feedback residuals, DiLoCo state and fp16 scale change during the next
backward, so they are captured before the step returns (they are copies).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..checkpoint.fingerprint import part_fingerprint
from ..checkpoint.flat import ShardExporter
from ..checkpoint.tensor_loan import TensorLoan
from ..checkpoint.state import block_of, export_shard


class SnapshotTimeout(RuntimeError):
    """The state of a snapshot was still being read when the training thread needed to change it."""


class SnapshotJob:
    """One snapshot in flight: a copy (``future``) or lent views (``loan`` with ``part``)."""

    def __init__(self, step: int, nbytes: int, future: Future | None = None, loan: TensorLoan | None = None,
                 part: dict | None = None):
        self.step, self.nbytes = step, nbytes
        self.future, self.loan, self._part = future, loan, part

    @property
    def lent(self) -> bool:
        return self.loan is not None

    def copied(self, timeout: float | None = None) -> dict:
        """The copy, once made (copy jobs only)."""
        return self.future.result(timeout)

    def take_part(self) -> dict:
        """The lent part, handed over once: the loan ends when the taker lets go of it."""
        part, self._part = self._part, None
        if part is None:
            raise RuntimeError(f"the lent part of step {self.step} was already taken")
        return part

    def done(self) -> bool:
        return self.future.done() if self.future is not None else self.loan.outstanding == 0

    def wait(self, timeout: float) -> None:
        """Until the live state may change again; raises ``SnapshotTimeout`` after ``timeout``."""
        if self.future is not None:
            try:
                self.future.result(timeout)
            except TimeoutError:
                raise SnapshotTimeout(f"snapshot of step {self.step}: the copy of {self.nbytes / 1e6:.0f} MB "
                                      f"is not done after {timeout:g} s") from None
        elif not self.loan.wait(timeout):
            raise SnapshotTimeout(
                f"snapshot of step {self.step}: the object store still reads the live state "
                f"({self.loan.outstanding} arrays) after {timeout:g} s"
                + ("" if self._part is None else "; nobody took the part"))


class SnapshotTaker:
    """Takes one rank's snapshots (see the module docstring). ``wait_timeout_s`` bounds the barrier."""

    def __init__(self, device: torch.device, wait_timeout_s: float, exporter: ShardExporter | None = None,
                 fingerprint: bool = False):
        """``exporter``: the worker's, whose buffers outlive this plan (``checkpoint.host_arena``);
        None: one of this taker's own. ``fingerprint``: each part carries its fingerprint
        (``checkpoint.verify_restores``)."""
        self.fingerprint = fingerprint
        self.device = device
        self.wait_timeout_s = wait_timeout_s
        self.exporter = exporter if exporter is not None else ShardExporter(pinned=device.type == "cuda")
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-copy")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.job: SnapshotJob | None = None

    @property
    def can_lend(self) -> bool:
        """Whether the live state has a host view to lend (CPU); on a GPU it is always copied."""
        return self.device.type == "cpu"

    def begin(self, step: int, lend: bool, named_params, optimizer, blocks: list[int], extra: dict,
              comm: dict, comm_meta: dict, ranges: dict | None = None) -> SnapshotJob:
        """Start taking the state after ``step``; ``lend``: lend the live tensors (needs ``can_lend``)
        instead of copying them, as a rank whose whole state goes to the object store does.
        ``ranges``: a sharded optimizer's slices, which ``named_params`` then are."""
        self.wait()
        named = list(named_params)
        nbytes = sum(p.nbytes + sum(v.nbytes for v in (optimizer.state.get(p) or {}).values() if torch.is_tensor(v))
                     for _, p in named)
        if lend:
            loan = TensorLoan()
            part = export_shard(step, named, optimizer, blocks, extra=extra, comm=comm, comm_meta=comm_meta,
                                loan=loan, ranges=ranges)
            if self.fingerprint:   # now, before the next update changes what is lent
                part["fingerprint"] = part_fingerprint(part)
            self.job = SnapshotJob(step, nbytes, loan=loan, part=part)
            return self.job
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            # After the update on the compute stream (named: a thread's current device is its own).
            ready.record(torch.cuda.current_stream(self.device))

        def copy() -> dict:
            if ready is None:
                shard = self.exporter.export(step, named, optimizer, blocks, block_of, extra=extra, comm=comm,
                                             comm_meta=comm_meta, ranges=ranges)
            else:
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(ready)
                    shard = self.exporter.export(step, named, optimizer, blocks, block_of, extra=extra, comm=comm,
                                                 comm_meta=comm_meta, non_blocking=True, ranges=ranges)
                self._stream.synchronize()
            if self.fingerprint:
                shard["fingerprint"] = part_fingerprint(shard)
            return shard

        self.job = SnapshotJob(step, nbytes, future=self._thread.submit(copy))
        return self.job

    def wait(self) -> float:
        """The barrier before the live state changes: seconds waited for the snapshot in flight."""
        job = self.job
        if job is None:
            return 0.0
        t0 = time.perf_counter()
        job.wait(self.wait_timeout_s)
        self.job = None
        return time.perf_counter() - t0

    @property
    def buffer_bytes(self) -> int:
        """Host memory in the copy buffers (local copies included)."""
        return self.exporter.nbytes

    def close(self) -> None:
        """Let a copy in flight finish (it is a valid copy of its step); lent views keep their tensors alive."""
        self._thread.shutdown(wait=True)

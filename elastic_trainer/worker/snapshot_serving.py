"""The actor's side of snapshots: taking one after a step, handing its object-store part to
the controller, keeping local copies and pinned copies of other ranks' parts, and serving them
to a restore (the "live replica" tier of recovery).

A mixin of ``TrainWorker``: it needs ``trainer``, ``faults``, ``gpu`` and ``worker_id``.
"""

from __future__ import annotations

import threading
import time

import ray

from ..checkpoint.slices import cut_moments
from ..checkpoint.state import select_blocks, shard_nbytes
from ..config import TrainerConfig
from .copies import HeldCopies
from .device import bind
from .local_wait import wait_local


class SnapshotServing:
    def _init_snapshots(self) -> None:
        self.copies = HeldCopies()
        # Snapshots in flight, for snapshot_part: step -> job, with the steps ended so far
        # (those that failed too) under one condition. A set-up clears them (``_setups``
        # counts them, so a call left from before it cannot take a part of the steps after).
        self._snap_cv = threading.Condition()
        self._jobs: dict[int, object] = {}
        self._ended = 0
        self._setups = 0
        self._overlap = True
        self._snapshot_wait_s = 60.0

    def _configure_snapshots(self, cfg: TrainerConfig) -> None:
        self.copies.keep = cfg.checkpoint.snapshots_kept
        self._overlap = cfg.checkpoint.overlap
        self._snapshot_wait_s = cfg.failure.startup_timeout_s + cfg.comm.timeout_s

    def _forget_snapshots(self) -> None:
        """A set-up or reset: the snapshots in flight are abandoned (local copies stay)."""
        with self._snap_cv:
            self._jobs.clear()  # a part nobody took ends its lease here
            self._ended = 0
            self._setups += 1
            self._snap_cv.notify_all()

    def _step_ended(self, step: int) -> None:
        """``step`` ended, well or not: a ``snapshot_part`` waiting on it stops waiting."""
        with self._snap_cv:
            self._ended = max(self._ended, step)
            self._snap_cv.notify_all()

    def _begin_snapshot(self, step: int, put_blocks: list[int] | None):
        # A rank that writes its whole state lends it: the object-store part is its only copy.
        lend = (bool(put_blocks) and set(put_blocks) >= set(self.trainer.blocks)
                and self.trainer.snapshots.can_lend)
        if not lend:
            self.copies.make_room()  # the copy's buffer is then one that was let go
        job = self.trainer.begin_snapshot(step, lend=lend)
        if not job.lent:
            def keep(fut, step=step):
                if fut.exception() is None:
                    self.copies.add_local(step, fut.result())
            job.future.add_done_callback(keep)
        with self._snap_cv:
            for old in [s for s in self._jobs if s < step]:
                del self._jobs[old]
            self._jobs[step] = job
            self._snap_cv.notify_all()
        return job

    def _copy_made(self) -> int | None:
        """The latest step whose local copy this worker has made since its set-up (None: none),
        as its step results report it (``copied``): the controller counts a DP peer's copy as a
        replica of a snapshot only once it is made. Read before the next snapshot begins, which
        may let that copy go; the update before it waited for the copy."""
        with self._snap_cv:
            made = [s for s, job in self._jobs.items()
                    if not job.lent and job.done() and job.future.exception() is None]
        return max(made, default=None)

    @ray.method(concurrency_group="snapshot")
    def snapshot_part(self, step: int, blocks: list[int], wait_s: float | None = None) -> dict:
        """The object-store part of ``step``'s snapshot that holds ``blocks``: returned, not put, so
        the caller (the controller) owns the object and it outlives this worker. Ray writes it
        into the object store on this call's thread while the next step runs. ``wait_s``: how
        long ``step`` may take to begin (a lease's last step), beyond the snapshot's own wait."""
        deadline = time.monotonic() + self._snapshot_wait_s + (wait_s or 0.0)
        with self._snap_cv:
            setups = self._setups
            while step not in self._jobs and self._ended < step and self._setups == setups:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"worker {self.worker_id}: step {step} did not end within "
                                       f"{self._snapshot_wait_s:g} s, so its snapshot part is not there")
                self._snap_cv.wait(left)
            if self._setups != setups:
                raise RuntimeError(f"worker {self.worker_id}: set up again before step {step} ended; "
                                   "its snapshot part is abandoned")
            job = self._jobs.get(step)
            if job is None:
                raise RuntimeError(f"worker {self.worker_id}: step {step} ended without a snapshot")
            if job.lent:
                return job.take_part()
        return select_blocks(job.copied(self._snapshot_wait_s), blocks)

    # -- local copies and restore sources -------------------------------------------
    @ray.method(concurrency_group="control")
    def local_steps(self) -> dict[int, list[int]]:
        """Steps this worker holds a local copy of, with the blocks each covers."""
        return self.copies.local_blocks()

    def export_snapshot(self, step: int) -> dict:
        """A local copy of the current state as ``step`` (for a final snapshot off the schedule)."""
        bind(self.gpu)
        shard = self.trainer.export(step)
        self.copies.add_local(step, shard)
        return shard

    def export_blocks(self, step: int, blocks: list[int]) -> dict:
        """The part of the local copy at ``step`` that holds ``blocks``."""
        return select_blocks(self.copies.local_copy(step), blocks)

    def pin(self, key: tuple, refs: list, keep_from: int) -> int:
        """Hold a copy of another rank's shard on this node so it outlives that node.

        ``key``: (step, rank, take), see ``HeldCopies.pin``. ``keep_from``: the oldest step the
        controller still keeps; copies of older steps are let go here, which spares it an unpin
        call per shard per step."""
        delay = self.faults.pin_delay(key[0])
        if delay:
            time.sleep(delay)
        wait_local(refs[:1])   # not a blocking get: it would stall this worker's restore reads
        return self.copies.pin(key, ray.get(refs[0]), keep_from)

    # Restore reads have threads of their own: in "snapshot" they could queue behind a
    # ``snapshot_part`` still waiting for a step the failure ended.
    @ray.method(concurrency_group="restore")
    def relay_part(self, refs: list, want: tuple | None = None) -> dict:
        """This worker's own snapshot part (``refs[0]``, in its node's object store) returned as a
        new object from here. The part's own object also has copies on its holders' nodes; when
        one of those just died, a reader's pull can try that node first and wait until Ray
        declares it dead (10-30 s), while the new object lies on this live node alone. ``want``: what
        the reader needs of it (``cut_for_reader``)."""
        return cut_for_reader(ray.get(refs[0]), want)

    @ray.method(concurrency_group="restore")
    def pinned_part(self, key: tuple, want: tuple | None = None) -> dict:
        """The copy this worker pinned of another rank's part (``key`` = (step, rank)), returned as a
        new object from this node: a restore whose part's own node died reads it from here, instead
        of waiting for Ray to give up on the dead node's copy (tens of seconds). ``want``: what the
        reader needs of it (``cut_for_reader``)."""
        return cut_for_reader(self.copies.pinned(tuple(key)), want)


def cut_for_reader(part: dict, want: tuple | None) -> dict:
    """What a restoring rank needs of a snapshot part: ``want`` = (its blocks, the moments' ranges it
    owns or None for all), with ``regather_nbytes``, what the part's blocks would have moved whole."""
    if want is None:
        return part
    blocks, owned = want
    part = select_blocks(part, blocks)
    whole = shard_nbytes(part)
    out = cut_moments(part, owned) if owned is not None else part   # a new dict either way
    out["regather_nbytes"] = whole
    return out

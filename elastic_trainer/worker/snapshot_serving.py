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
        self._generation = 0      # the set-up the steps now run under: each local copy carries it
        self._timeline: list = []  # the run's restores, as its set-ups named them (``copies.on_timeline``)

    def _configure_snapshots(self, cfg: TrainerConfig, generation: int = 0, timeline: list | None = None) -> None:
        self.copies.keep = cfg.checkpoint.snapshots_kept
        self._generation = generation
        if timeline is not None:
            self._timeline = [tuple(t) for t in timeline]
            self.copies.drop_abandoned(self._timeline)
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
            # A copy still being made when its step failed lands after the set-up that rolled it back:
            # its generation and the timeline then say it is not the run's.
            def keep(fut, step=step, generation=self._generation):
                if fut.exception() is None:
                    self.copies.add_local(step, fut.result(), generation, self._timeline)
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
    def local_steps(self, timeline: list | None = None, settle_s: float = 0.0) -> dict[int, list[int]]:
        """Steps this worker holds a local copy of, with the blocks each covers: only copies of
        the run's ``timeline`` (``(generation, restored step)`` of its set-ups, and the one about to
        be; ``copies.on_timeline``), which is kept for the copies still to come. ``settle_s``: a
        re-plan between steps (a grow) first lets the copy in flight finish, up to that long, so
        the step just ended is a source and nothing is redone."""
        if settle_s > 0:
            self._settle_copy(settle_s)
        if timeline is not None:
            # The controller's word is the newest: copies it shows abandoned go, and a late one is refused.
            self._timeline = [tuple(t) for t in timeline]
            self.copies.drop_abandoned(self._timeline)
        return self.copies.local_blocks(self._timeline)

    def _settle_copy(self, wait_s: float) -> None:
        with self._snap_cv:
            jobs = [(s, job) for s, job in self._jobs.items() if not job.lent]
            generation = self._generation
        for step, job in jobs:
            try:
                # Kept here as well as by its callback: a waiter may wake before the callback ran.
                self.copies.add_local(step, job.copied(wait_s), generation, self._timeline)
            except Exception:  # noqa: BLE001 - a copy that failed or is late is no source; older ones are
                pass

    def export_snapshot(self, step: int) -> dict:
        """A local copy of the current state as ``step`` (for a final snapshot off the schedule)."""
        bind(self.gpu)
        shard = self.trainer.export(step)
        self.copies.add_local(step, shard, self._generation)
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

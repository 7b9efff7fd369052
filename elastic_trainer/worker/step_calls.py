"""A worker's training calls: a step, a lease of steps, an evaluation, and how a failed one is left.

A mixin of ``TrainWorker`` (on its ``train`` concurrency group, one call at a time): it needs
``trainer``, ``groups``, ``faults``, ``rank``, ``worker_id``, ``run_name``, ``gpu``, the lease
order and the snapshot hooks of ``SnapshotServing``.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback

import ray

from ..errors import error_line
from ..integrity.anomaly import StepAnomaly
from .device import bind
from .memory_kills import grow_until_killed
from .step_answer import anomaly_answer, step_answer

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised by a step that a test asked to fail."""


class StepCalls:
    @ray.method(concurrency_group="train")
    def train_step(self, step: int, snapshot: bool, put_blocks: list[int] | None = None,
                   timeout_s: float | None = None, shares: list[int] | None = None,
                   checks: list[int] | None = None) -> dict:
        """Run ``step`` (``_train_step``), one step or lease at a time; a step judged anomalous
        (``integrity``) and not skipped answers ``anomaly_answer``'s mark instead."""
        with self._train_lock:
            try:
                return self._train_step(step, snapshot, put_blocks, timeout_s, shares, step in (checks or ()))
            except StepAnomaly as e:
                return anomaly_answer(self.rank, e)

    def _train_step(self, step: int, snapshot: bool, put_blocks: list[int] | None = None,
                    timeout_s: float | None = None, shares: list[int] | None = None, check: bool = False) -> dict:
        """Run ``step``. With ``snapshot``, start taking this rank's state after it; the copy
        overlaps the next step (``checkpoint.overlap``), and ``snapshot_part`` hands over the
        part holding ``put_blocks``. Other ranks keep it as a local copy; a rank that writes
        all its blocks lends its live state for the object store to copy, and keeps no other
        copy: the part written is it. ``timeout_s``: the controller's step timeout, which bounds
        the step on backends whose collectives do not fail by themselves (``step_guard``).
        ``shares``: micro-batches per replica, where balancing moved some off a slow one.
        ``check``: fingerprint the state after it (``state_checks``), for the controller to compare."""
        t0 = time.perf_counter()
        job = None
        bind(self.gpu)
        self._busy += 1
        self._step_thread = threading.get_ident()
        try:
            if self.faults.injected("raise", step):
                raise InjectedFault(f"injected fault in step {step} on worker {self.worker_id}")
            if self.faults.injected("grow_memory", step):
                grow_until_killed()
            self.trainer.clock.slow_factor = self.faults.compute_factor(step)
            with self.groups.guarded(f"step {step}", timeout_s):
                r = self.trainer.train_step(step, shares)
            if check:
                r.fingerprints, r.check_s = self.trainer.state_checks.fingerprint()
            copied = self._copy_made()   # before this step's snapshot may let that copy go
            if snapshot:
                delay = self.faults.snapshot_delay()
                if delay:
                    time.sleep(delay)  # a test's stand-in for a snapshot that costs the step this long
                job = self._begin_snapshot(step, put_blocks)
                if not self._overlap:
                    self.trainer.snapshots.wait()  # synchronous: the step ends once the state is out
        except StepAnomaly:
            raise   # applied nowhere, on any rank: the stage and its groups are as after the last step
        except BaseException as e:
            self._abandon(e, f"step {step}")
            raise
        finally:
            self._busy -= 1
            self._step_ended(step)
        self._done_step = step
        self._idle_since = time.perf_counter()
        return step_answer(self.rank, r, job.nbytes if job and put_blocks else 0,
                           self.trainer.snapshots.buffer_bytes, copied, t0, self.trainer.device)

    @ray.method(concurrency_group="train")
    def train_lease(self, first: int, count: int, snapshot_last: bool, put_blocks: list[int] | None = None,
                    timeout_s: float | None = None, shares: list[int] | None = None,
                    grant: int | None = None, after: int | None = None,
                    checks: list[int] | None = None) -> list[dict]:
        """Steps ``first`` .. ``first + count - 1`` on this rank's own (a lease the controller
        granted), each as ``train_step``; with ``snapshot_last`` the last takes the snapshot. The
        results of every step, in order. A step that fails ends the lease with its error, and
        ``last_step`` says how far it got.

        ``grant``: this lease's number. ``after``: the number of the lease this one was granted
        behind, before that one ended (``control.renew_early``): it waits for that one to end
        here, runs only if it completed, and raises ``lease_order.LeaseRefused`` otherwise (the controller
        is then recovering from it). The first step's result carries ``gap_s``, how long this
        rank sat idle since its last call ended (what waiting for the controller between
        leases cost it)."""
        if after is not None:
            self._lease_order.await_end(after, f"the lease of steps {first}..{first + count - 1}")
        out = []
        with self._train_lock:
            gap = None if self._idle_since is None else time.perf_counter() - self._idle_since
            self._done_step = first - 1   # a step rolled back since may have been done before
            self._busy += 1   # between its steps too: the lease goes on to issue more
            try:
                for step in range(first, first + count):
                    snap = snapshot_last and step == first + count - 1
                    try:
                        out.append(self._train_step(step, snap, put_blocks if snap else None, timeout_s, shares,
                                                    step in (checks or ())))
                    except StepAnomaly as e:
                        # Every rank ends its lease here alike: the steps before it stand, this
                        # one's mark last; the lease queued behind is refused (not all ran).
                        out.append(anomaly_answer(self.rank, e))
                        break
            finally:
                self._busy -= 1
                if grant is not None:
                    self._lease_order.ended(grant, len(out) == count and "anomaly_mark" not in out[-1])
        out[0]["gap_s"] = gap
        return out

    @ray.method(concurrency_group="control")
    def last_step(self) -> int:
        """The last step this rank completed (0 before the first)."""
        return self._done_step

    def evaluate(self, step: int, timeout_s: float | None = None) -> dict:
        """The held-out loss after ``step`` on this plan (``StageTrainer.evaluate``); a failure
        leaves the groups like a failed step does."""
        t0 = time.perf_counter()
        bind(self.gpu)
        self._busy += 1
        try:
            if self.faults.injected("raise_eval", step):
                raise InjectedFault(f"injected fault in the evaluation after step {step} on worker {self.worker_id}")
            with self.groups.guarded(f"the evaluation after step {step}", timeout_s):
                loss = self.trainer.evaluate(step)
        except BaseException as e:
            self._abandon(e, f"the evaluation after step {step}")
            raise
        finally:
            self._busy -= 1
        self._idle_since = time.perf_counter()
        return {"rank": self.rank, "loss": loss, "seconds": time.perf_counter() - t0}

    def _abandon(self, e: BaseException, what: str) -> None:
        """Leave the groups after ``what`` failed with ``e``: the traceback's frames hold the
        stage and its groups, so they are cleared first (see reset())."""
        log.warning("[%s] worker %d: %s failed on rank %s: %s", self.run_name, self.worker_id, what,
                    self.rank, error_line(e))
        traceback.clear_frames(e.__traceback__)
        # gloo: the groups stay until the controller says which the next plan keeps (settle_groups).
        self._reset(hold=self._hold_on_failure and self.groups.backend == "gloo")

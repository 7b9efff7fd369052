"""A deadline on each step, for backends whose collectives do not raise when a peer dies.

An NCCL collective with a dead peer waits on the GPU; the training thread
then blocks wherever it next waits for the GPU (a ``float(loss)``, a
gradient-overflow check), with nothing to raise there. The guard runs beside
it: once a step has run for the collective timeout it calls ``on_expiry``
(abort the groups), which ends the pending kernels, and the step then raises
:class:`CollectiveTimeout` instead of returning what the aborted work left.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class CollectiveTimeout(RuntimeError):
    """A step ran past its timeout, or its collectives were ended from outside, and its groups were aborted."""


class StepGuard:
    """Calls ``on_expiry(what)`` from its own thread when a watched block outlives ``timeout_s``."""

    def __init__(self, on_expiry: Callable[[str], None]):
        self._on_expiry = on_expiry
        self._cv = threading.Condition()
        self._deadline: float | None = None
        self._what = ""
        self._expired: str | None = None   # why the watched block was ended, once it was
        self._closed = False
        self._timeout_s = 0.0
        self._thread = threading.Thread(target=self._run, name="step-guard", daemon=True)
        self._thread.start()

    @contextmanager
    def watch(self, what: str, timeout_s: float) -> Iterator[None]:
        """Guard the block: raises :class:`CollectiveTimeout` at its end if the deadline passed
        inside it, or :meth:`trip` ended it (whatever the block itself returned or raised)."""
        with self._cv:
            self._deadline, self._what, self._expired = time.monotonic() + timeout_s, what, None
            self._timeout_s = timeout_s
            self._cv.notify_all()
        try:
            yield
        except BaseException as e:
            why = self._disarm()
            if why:
                raise CollectiveTimeout(f"{what} was ended: {why}; its process groups were aborted") from e
            raise
        why = self._disarm()
        if why:
            raise CollectiveTimeout(f"{what} was ended: {why}; its process groups were aborted")

    def trip(self, why: str) -> None:
        """End the watched block from outside (its collectives were aborted): it raises at its end."""
        with self._cv:
            if self._deadline is not None:
                self._expired, self._deadline = why, None
                self._cv.notify_all()

    def _disarm(self) -> str | None:
        with self._cv:
            self._deadline = None
            return self._expired

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                if self._deadline is None:
                    self._cv.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                self._expired = f"it ran past its timeout ({self._timeout_s:g} s)"
                self._deadline, what = None, self._what
                self._cv.release()
                try:
                    self._on_expiry(what)
                finally:
                    self._cv.acquire()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

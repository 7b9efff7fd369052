"""Runs a worker's leases in the order the controller granted them.

A worker is a threaded actor: Ray starts its calls as they come, not in the
order the controller made them, so a lease granted behind a running one
(``control.renew_early``) may arrive first. The ``train`` group holds a
thread for it, and it waits here for the lease it follows to end on this
worker, then runs only if that one completed.
"""

from __future__ import annotations

import threading

# Leases whose end is remembered: a queued lease follows the one granted just before it.
_KEEP = 8


class LeaseRefused(RuntimeError):
    """A lease granted behind another that did not complete on this rank."""


class LeaseOrder:
    def __init__(self, who: str):
        self.who = who
        self._cv = threading.Condition()
        self._ended: dict[int, bool] = {}   # lease number -> whether it completed

    def ended(self, grant: int, completed: bool) -> None:
        """Lease ``grant`` ended here, all its steps done (``completed``) or not."""
        with self._cv:
            self._ended[grant] = completed
            while len(self._ended) > _KEEP:
                self._ended.pop(next(iter(self._ended)))
            self._cv.notify_all()

    def await_end(self, grant: int, what: str, timeout_s: float | None = None) -> None:
        """Wait until lease ``grant`` has ended here; raise ``LeaseRefused`` (naming ``what``,
        the lease waiting) if it did not complete or did not end within ``timeout_s``. It ends
        one way or the other: it completes, raises, or a cut ends the collective it waits in
        (a worker that hangs past that is dropped by the controller)."""
        with self._cv:
            if not self._cv.wait_for(lambda: grant in self._ended, timeout=timeout_s):
                raise LeaseRefused(f"{self.who}: {what} was granted behind lease {grant}, which did not end "
                                   f"here within {timeout_s:g} s")
            completed = self._ended[grant]
        if not completed:
            raise LeaseRefused(f"{self.who}: {what} was granted behind lease {grant}, which did not complete here")

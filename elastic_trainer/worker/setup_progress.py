"""How far a set-up has got: a count the controller reads to tell slow from stuck.

A set-up's time grows with the bytes it builds, loads or fetches, and a large
stage can take longer than any fixed bound. Each part of it ticks this count
as it goes (a block built or read, a restore source fetched); the controller
asks for it when a set-up passes its time (``controller.workers.get_all``)
and waits on while the count still moves.
"""

from __future__ import annotations

import threading


class SetupProgress:
    """A count of the units of work done by this process's set-up, and their bytes."""

    def __init__(self):
        self._lock = threading.Lock()
        self.units = 0
        self.nbytes = 0

    def begin(self) -> None:
        """A set-up starts: its count starts at nothing."""
        with self._lock:
            self.units = self.nbytes = 0

    def tick(self, nbytes: int = 0) -> None:
        with self._lock:
            self.units += 1
            self.nbytes += int(nbytes)

    def read(self) -> tuple[int, int]:
        """(units, bytes) so far."""
        with self._lock:
            return self.units, self.nbytes


PROGRESS = SetupProgress()

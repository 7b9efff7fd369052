"""Byte and time counters of a step's collectives."""

from __future__ import annotations

from dataclasses import dataclass, field

from .timing import EventTimer, WallTimer


@dataclass
class CommStats:
    """What the collectives of one step cost.

    Times given as stopped timers (``comm.timing``) are read when ``seconds``
    is first read: CUDA event times are then read after the step's work, not
    by a synchronisation after every collective.
    """

    bytes: int = 0
    calls: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    _seconds: float = 0.0
    _pending: list = field(default_factory=list)

    def add(self, op: str, nbytes: int, seconds: float | WallTimer | EventTimer) -> None:
        """Count one collective: ``nbytes`` sent, taking ``seconds`` (a number or a stopped timer)."""
        self.bytes += nbytes
        self.calls += 1
        self.by_op[op] = self.by_op.get(op, 0) + nbytes
        if isinstance(seconds, (int, float)):
            self._seconds += seconds
        else:
            self._pending.append(seconds)

    @property
    def seconds(self) -> float:
        """Seconds in collectives (reading it waits for pending CUDA timers' events)."""
        if self._pending:
            self._seconds += sum(t.seconds() for t in self._pending)
            self._pending = []
        return self._seconds

    def merge(self, other: CommStats) -> None:
        """Add ``other``'s counts into this one (its pending timers stay pending)."""
        self.bytes += other.bytes
        self.calls += other.calls
        for op, n in other.by_op.items():
            self.by_op[op] = self.by_op.get(op, 0) + n
        self._seconds += other._seconds
        self._pending.extend(other._pending)

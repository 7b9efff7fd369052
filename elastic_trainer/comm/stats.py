"""Byte and time counters of a step's collectives."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CommStats:
    """What the collectives of one step cost."""

    bytes: int = 0
    seconds: float = 0.0
    calls: int = 0
    by_op: dict[str, int] = field(default_factory=dict)

    def add(self, op: str, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.seconds += seconds
        self.calls += 1
        self.by_op[op] = self.by_op.get(op, 0) + nbytes

"""Rank layout of a dp x pp run.

Rank ``r`` holds pipeline stage ``r % pp`` of replica ``r // pp``. Each stage
has a DP group (its replicas) and each replica a PP group (its stages).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    dp: int
    pp: int

    def __post_init__(self):
        if self.dp < 1 or self.pp < 1:
            raise ValueError(f"dp({self.dp}) and pp({self.pp}) must both be >= 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    def rank(self, replica: int, stage: int) -> int:
        return replica * self.pp + stage

    def coords(self, rank: int) -> tuple[int, int]:
        """(replica, stage) of ``rank``."""
        return divmod(rank, self.pp)

    def dp_group_ranks(self, stage: int) -> list[int]:
        return [self.rank(r, stage) for r in range(self.dp)]

    def pp_group_ranks(self, replica: int) -> list[int]:
        return [self.rank(replica, s) for s in range(self.pp)]

    def __str__(self) -> str:
        return f"dp={self.dp} x pp={self.pp}"

"""Byte and time counters of a step's collectives, and gradient bucketing (used by grad_sync)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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


def make_buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Group parameters, in reverse order (the order backward produces grads), into buckets.

    A bucket holds parameters of one dtype and device so it flattens into one tensor.
    """
    buckets: list[list[torch.nn.Parameter]] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for p in reversed(params):
        if not p.requires_grad:
            continue
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > bucket_bytes or p.dtype != current[0].dtype or p.device != current[0].device):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets

"""Bucketed gradient averaging across a data-parallel group, with byte and time counters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


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


class GradAverager:
    """Averages gradients of a stage's parameters over its DP group, one flat buffer per bucket."""

    def __init__(self, params: list[torch.nn.Parameter], group, group_size: int, bucket_mb: float):
        self.group = group
        self.group_size = group_size
        self.buckets = make_buckets(params, int(bucket_mb * (1 << 20)))

    def average(self, stats: CommStats) -> None:
        if self.group_size == 1:
            return
        for bucket in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            t0 = time.perf_counter()
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            stats.add("all_reduce", flat.numel() * flat.element_size(), time.perf_counter() - t0)
            flat.div_(self.group_size)
            offset = 0
            for p in bucket:
                n = p.numel()
                chunk = flat[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = chunk.clone()
                else:
                    p.grad.copy_(chunk)
                offset += n

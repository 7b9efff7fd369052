"""Gradient buckets: parameters grouped so that each bucket flattens into one tensor for one collective."""

from __future__ import annotations

import torch


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

"""A top-k all-reduce whose bytes per rank do not grow with dp: scatter by index range, sum,
re-sparsify, all-gather (as Ok-Topk, PPoPP'22, and gTop-k do).

The all-gather top-k sends every rank's ``k`` entries to every other rank, so a
rank sends ``(p - 1) k`` pairs and receives as many. Here the index space
``[0, N)`` is cut into ``p`` contiguous ranges, range ``j`` owned by rank
``j``, and with ``c = ceil(k / (p - 1))``:

1. each rank takes, in every range, its ``c`` largest-magnitude entries of
   gradient plus residual, and sends range ``j``'s to rank ``j``
   (all-to-all: ``c`` index-value pairs to each peer, ``k`` in all);
2. each owner sums what the ``p`` ranks sent for its range (its own
   included), keeps the ``c`` largest of that sum, and all-gathers them
   (``c`` pairs to each peer: ``k`` again).

So a rank sends about ``2k`` pairs at any ``p``. Nothing is lost, only owed
(error feedback): a rank's unsent entries stay in its residual, and the part
of a range's sum its owner does not keep goes into the owner's residual,
which its next gradient carries into the next sum (where the average takes
it once, as the sum's ``1/p``). Where ``c`` covers a range every entry is sent
and kept: the dense average.

Selection per range, rather than over the whole bucket, is what fixes each
message's size in advance (no count exchange, and an all-to-all with known
splits); a range whose entries matter more than others' sends no more than
``c`` a step, the rest waiting in the residual.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .codec import timed
from .stats import CommStats


def ranges(numel: int, p: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` index range each of ``p`` ranks owns."""
    return [(j * numel // p, (j + 1) * numel // p) for j in range(p)]


def per_range(k: int, p: int) -> int:
    """Entries a rank sends for each other rank's range (and an owner keeps of its own)."""
    return max(1, math.ceil(k / max(1, p - 1)))


def _counts(numel: int, p: int, k: int) -> list[int]:
    c = per_range(k, p)
    return [min(c, b - a) for a, b in ranges(numel, p)]


def sparse_reduce_bytes(numel: int, p: int, k: int, value_bytes: int = 4) -> int:
    """Bytes one rank sends (its all-to-all parts for the others, then its all-gather part to
    each peer) to average ``numel`` entries over ``p`` ranks at ``k`` pairs a phase."""
    if p < 2:
        return 0
    # Both phases send every peer one part of the widest range's count (shorter ones are padded).
    return 2 * (p - 1) * max(_counts(numel, p, k)) * (4 + value_bytes)


def _to_wire(vals: torch.Tensor, value_dtype: torch.dtype) -> torch.Tensor:
    if value_dtype == torch.float16:
        vals = vals.clamp(-65504.0, 65504.0)
    return vals.to(value_dtype)


def _padded(idx: torch.Tensor, vals: torch.Tensor, width: int, at: int) -> tuple[torch.Tensor, torch.Tensor]:
    pad = width - idx.numel()
    if pad == 0:
        return idx, vals
    return (torch.cat([idx, torch.full((pad,), at, dtype=idx.dtype, device=idx.device)]),
            torch.cat([vals, torch.zeros(pad, dtype=vals.dtype, device=vals.device)]))


def _pack(idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    # Indices first: the 4-byte ones stay aligned whatever the value width.
    return torch.cat([idx.to(torch.int32).view(torch.uint8), vals.view(torch.uint8)])


def _unpack(buf: torch.Tensor, n: int, value_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # A part of a received buffer starts where the parts before it end: with 2-byte values that
    # need not be 4-aligned, and a view must be, so such a part is copied first.
    if buf.storage_offset() % 4:
        buf = buf.clone()
    return buf[:4 * n].view(torch.int32).long(), buf[4 * n:].view(value_dtype).float()


def sparse_allreduce(x: torch.Tensor, k: int, group, p: int, rank: int, stats: CommStats | None,
                     value_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The average over the group of the top-k sparsified ``x`` (one flat fp32 tensor per rank),
    and what this rank still owes (``x`` less what it sent, plus what its range's re-sparsify
    dropped): ``(average, residual)``. ``p``, ``rank``: the group's size and this rank in it."""
    n = x.numel()
    if n == 0:
        return torch.zeros_like(x), x.clone()
    bounds = ranges(n, p)
    counts = _counts(n, p, k)
    # Every part has the widest range's count: the collectives take equal parts, and a shorter
    # range pads with zeros at its own first index (adding 0 there changes nothing).
    width = max(counts)
    residual = x.clone()
    chunks = []
    for (a, b), c in zip(bounds, counts):
        seg = residual[a:b]
        top = seg.abs().topk(c, sorted=False).indices
        sent = _to_wire(seg[top], value_dtype)
        seg[top] -= sent.float()
        chunks.append(_pack(*_padded(top + a, sent, width, min(a, n - 1))))
    send = torch.cat(chunks)
    part = width * (4 + torch.finfo(value_dtype).bits // 8)
    recv = torch.empty(p * part, dtype=torch.uint8, device=x.device)
    timed(stats, "all_to_all", (p - 1) * part, x.device, dist.all_to_all_single, recv, send, group=group)
    a, b = bounds[rank]
    total = torch.zeros(b - a, dtype=torch.float32, device=x.device)
    for got in (recv.split(part) if b > a else ()):   # an empty range (numel < p) receives padding only
        idx, vals = _unpack(got, width, value_dtype)
        total.index_add_(0, idx - a, vals)
    keep = total.abs().topk(counts[rank], sorted=False).indices
    kept = _to_wire(total[keep], value_dtype)
    # What the owner does not keep of its range's sum, it owes: carried by its own next gradient.
    total[keep] -= kept.float()
    residual[a:b] += total
    # An empty range's padding goes to index 0 (its own first index may be n, past the end).
    message = _pack(*_padded(keep + a, kept, width, a if a < n else 0))
    gathered = [torch.empty_like(message) for _ in range(p)]
    timed(stats, "all_gather", (p - 1) * message.numel(), x.device, dist.all_gather, gathered, message, group=group)
    avg = torch.zeros_like(x)
    for m in gathered:
        i, v = _unpack(m, width, value_dtype)
        avg.index_add_(0, i, v)
    avg.div_(p)
    return avg, residual

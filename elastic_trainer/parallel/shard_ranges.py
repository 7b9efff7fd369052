"""Which elements of each gradient bucket a rank of a DP group owns when the optimizer is sharded.

A bucket's gradients flatten into one vector of ``numel`` elements (its
parameters back to back). Padded to a multiple of the group size ``p``, it
splits into ``p`` equal shards: group rank ``j`` owns elements
``[j * c, (j + 1) * c)`` with ``c = ceil(numel / p)``, the last shard cut short
by the padding. Every bucket is split so, so a rank owns 1/p of every
bucket, within ``p - 1`` elements of padding per bucket. Pure: no torch.
"""

from __future__ import annotations


def shard_len(numel: int, p: int) -> int:
    """Elements in each of the ``p`` equal shards of a bucket of ``numel`` (padding included)."""
    return -(-numel // p)


def owned(numel: int, p: int, j: int) -> tuple[int, int]:
    """``[lo, hi)``: the elements of a bucket of ``numel`` that group rank ``j`` of ``p`` owns (padding excluded)."""
    if not 0 <= j < p:
        raise ValueError(f"group rank {j} is outside a group of {p}")
    c = shard_len(numel, p)
    return min(j * c, numel), min((j + 1) * c, numel)


def owned_slices(sizes: list[int], lo: int, hi: int) -> list[tuple[int, int, int, int]]:
    """The parts of a bucket's parameters (``sizes``, in bucket order) that fall in ``[lo, hi)``:
    ``(parameter index, start, end within that parameter, offset in the shard)``."""
    out, offset = [], 0
    for i, n in enumerate(sizes):
        a, z = max(lo, offset), min(hi, offset + n)
        if a < z:
            out.append((i, a - offset, z - offset, a - lo))
        offset += n
    return out

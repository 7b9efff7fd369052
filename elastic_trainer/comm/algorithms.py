"""All-reduce algorithms built from point-to-point ops, so the cost model has more than one to choose from.

Every algorithm has the signature ``(tensor, group, stats) -> None``: it sums
``tensor`` in place over ``group`` (``None`` is the default group) and adds the
bytes this rank sent to ``stats`` (which may be ``None``).

- ``ring``: the backend's own ``dist.all_reduce``, counted as a ring's
  ``2(p-1)/p * N`` (what gloo's CPU ring and NCCL's ring send).
- ``tree``: recursive halving (reduce-scatter) then recursive doubling
  (all-gather), Rabenseifner's algorithm. ``2 log2 p`` latency steps instead of
  the ring's ``2(p-1)``, same bytes for a power-of-two ``p``.
- ``chunked``: a ring reduce-scatter + all-gather over p2p ops, each ring
  segment cut into chunks that move through the ring one tick apart, so a
  chunk is being reduced while the next one is on the wire.

Peers are addressed by global rank (``dist.get_global_rank``): p2p ops take
global ranks even when a group is given, and a DP subgroup's rank 1 is
rarely global rank 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .stats import CommStats
from .timing import start_timer

ALGORITHMS = ("ring", "tree", "chunked")
DEFAULT_CHUNK_BYTES = 1 << 20


def ring_allreduce_bytes(nbytes: int, p: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: ``2(p-1)/p * nbytes`` (floored)."""
    return 2 * (p - 1) * nbytes // p


def _group_info(group) -> tuple[object, int, int]:
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the group it was asked to all-reduce over")
    return group, dist.get_world_size(group), rank


def _exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group) -> int:
    """Post every send and receive (group ranks) at once, wait for all; return bytes sent.

    Empty tensors are skipped on both sides: both ends derive sizes from the
    same split, so a skipped send always has a matching skipped receive.
    """
    ops = [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group) for t, peer in recvs if t.numel()]
    ops += [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group) for t, peer in sends if t.numel()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return sum(t.numel() * t.element_size() for t, _ in sends)


def _run(fn: Callable[..., int], op: str, tensor: torch.Tensor, group, stats: CommStats | None, **kwargs) -> None:
    """Run ``fn`` on a contiguous 1-D view (copying back if the tensor was not contiguous) and count it."""
    group, p, rank = _group_info(group)
    if p == 1:
        return
    copied = not tensor.is_contiguous()
    flat = tensor.contiguous().view(-1) if copied else tensor.view(-1)
    timer = start_timer(tensor.device)
    sent = fn(flat, group, p, rank, **kwargs)
    if copied:
        tensor.copy_(flat.view_as(tensor))
    if stats is not None:
        stats.add(op, sent, timer.stop())


def ring_allreduce(tensor: torch.Tensor, group=None, stats: CommStats | None = None) -> None:
    """Sum ``tensor`` in place with the backend's all-reduce; count the ring's bytes."""
    group, p, _ = _group_info(group)
    if p == 1:
        return
    timer = start_timer(tensor.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    if stats is not None:
        stats.add("all_reduce", ring_allreduce_bytes(tensor.numel() * tensor.element_size(), p), timer.stop())


def _fold(p: int) -> tuple[int, int]:
    """(largest power of two <= p, how many ranks beyond it must fold into a partner first)."""
    p2 = 1 << (p.bit_length() - 1)
    return p2, p - p2


def _tree(flat: torch.Tensor, group, p: int, rank: int) -> int:
    """Sum ``flat`` in place by recursive halving-doubling (Rabenseifner).

    For a ``p`` that is not a power of two, the first ``2 * (p - p2)`` ranks
    pair up: each even one hands its whole vector to the odd one above it,
    sits out the ``p2``-rank halving-doubling, and gets the result back at
    the end. That costs two extra full-vector steps for those pairs, which
    is cheaper than a halving-doubling over a ragged rank count.
    """
    n = flat.numel()
    p2, extra = _fold(p)
    sent = 0
    if rank < 2 * extra:
        if rank % 2 == 0:
            sent += _exchange([(flat, rank + 1)], [], group)
            _exchange([], [(flat, rank + 1)], group)
            return sent
        buf = torch.empty_like(flat)
        _exchange([], [(buf, rank - 1)], group)
        flat.add_(buf)
        vrank = rank // 2
    else:
        vrank = rank - extra

    def real(v: int) -> int:
        return 2 * v + 1 if v < extra else v + extra

    # Reduce-scatter: each step halves the range this rank is responsible for.
    lo, hi = 0, n
    history: list[tuple[int, int, tuple[int, int], int]] = []
    d = p2 >> 1
    while d >= 1:
        partner = vrank ^ d
        mid = lo + (hi - lo) // 2
        keep, give = ((lo, mid), (mid, hi)) if vrank < partner else ((mid, hi), (lo, mid))
        history.append((lo, hi, give, partner))
        buf = torch.empty(keep[1] - keep[0], dtype=flat.dtype, device=flat.device)
        sent += _exchange([(flat[give[0]:give[1]], real(partner))], [(buf, real(partner))], group)
        flat[keep[0]:keep[1]].add_(buf)
        lo, hi = keep
        d >>= 1
    # All-gather: replay the halvings backwards; the half given away comes back finished.
    for plo, phi, give, partner in reversed(history):
        sent += _exchange([(flat[lo:hi], real(partner))], [(flat[give[0]:give[1]], real(partner))], group)
        lo, hi = plo, phi
    if rank < 2 * extra:
        sent += _exchange([(flat, rank - 1)], [], group)
    return sent


def _split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    n = hi - lo
    return [(lo + i * n // parts, lo + (i + 1) * n // parts) for i in range(parts)]


def _ring_chunks(n: int, p: int, element_size: int, chunk_bytes: int) -> list[list[tuple[int, int]]]:
    """``chunks[segment][c]``: the element ranges each ring segment is cut into (same count per segment)."""
    if chunk_bytes < element_size:
        raise ValueError(f"chunk_bytes={chunk_bytes} is smaller than one element ({element_size} bytes)")
    segments = _split(0, n, p)
    longest = max(hi - lo for lo, hi in segments)
    count = max(1, -(-longest * element_size // chunk_bytes))
    return [_split(lo, hi, count) for lo, hi in segments]


def _chunked(flat: torch.Tensor, group, p: int, rank: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Sum ``flat`` in place by a pipelined ring: reduce-scatter then all-gather, chunk by chunk.

    Chunk ``c`` runs ring step ``t - c`` at tick ``t``, so up to ``2(p-1)``
    chunks are in flight at once and receiving one overlaps adding another.
    ``chunk_bytes`` bounds each message (and the scratch memory per chunk).
    """
    chunks = _ring_chunks(flat.numel(), p, flat.element_size(), chunk_bytes)
    count = len(chunks[0])
    steps = 2 * (p - 1)
    right, left = (rank + 1) % p, (rank - 1) % p
    sent = 0
    for tick in range(steps + count - 1):
        sends, recvs = [], []
        for c in range(max(0, tick - steps + 1), min(count, tick + 1)):
            step = tick - c
            if step < p - 1:
                # Reduce-scatter: pass on the segment summed last step, add the one arriving.
                out_lo, out_hi = chunks[(rank - step) % p][c]
                in_lo, in_hi = chunks[(rank - step - 1) % p][c]
                recvs.append((torch.empty(in_hi - in_lo, dtype=flat.dtype, device=flat.device), left,
                              flat[in_lo:in_hi], c))
            else:
                # All-gather: finished segments arrive straight into place.
                s = step - (p - 1)
                out_lo, out_hi = chunks[(rank + 1 - s) % p][c]
                in_lo, in_hi = chunks[(rank - s) % p][c]
                recvs.append((flat[in_lo:in_hi], left, None, c))
            sends.append((flat[out_lo:out_hi], right, c))
        recvs = [r for r in recvs if r[0].numel()]
        # One tag per chunk, so a receive can only match the chunk it was posted for.
        ops = [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group, c) for t, peer, _, c in recvs]
        ops += [dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group, c)
                for t, peer, c in sends if t.numel()]
        works = dist.batch_isend_irecv(ops) if ops else []
        if len(works) == len(ops):
            # One work per op (gloo): add each chunk as soon as it lands, while later ones still move.
            for (buf, _, dst, _), work in zip(recvs, works):
                work.wait()
                if dst is not None:
                    dst.add_(buf)
            for work in works[len(recvs):]:
                work.wait()
        else:
            # A coalescing backend (NCCL) hands back one work for the whole batch.
            for work in works:
                work.wait()
            for buf, _, dst, _ in recvs:
                if dst is not None:
                    dst.add_(buf)
        sent += sum(t.numel() * t.element_size() for t, _, _ in sends)
    return sent


def tree_allreduce(tensor: torch.Tensor, group=None, stats: CommStats | None = None) -> None:
    """Sum ``tensor`` in place over ``group`` by recursive halving-doubling; count the bytes sent.

    ``2 * log2(p2)`` exchanges (``p2`` the largest power of two <= p), plus two
    full-vector hops for the ranks folded in when ``p`` is not a power of two.
    """
    _run(_tree, "tree_allreduce", tensor, group, stats)


def chunked_allreduce(tensor: torch.Tensor, group=None, stats: CommStats | None = None,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
    """Sum ``tensor`` in place over ``group`` by a pipelined, chunked ring; count the bytes sent.

    Messages are at most ``chunk_bytes``; the bytes are the ring's ``2(p-1)/p * N``.
    """
    _run(_chunked, "chunked_allreduce", tensor, group, stats, chunk_bytes=chunk_bytes)


def get_algorithm(name: str) -> Callable[..., None]:
    """The all-reduce function called ``name`` (one of :data:`ALGORITHMS`)."""
    table = {"ring": ring_allreduce, "tree": tree_allreduce, "chunked": chunked_allreduce}
    if name not in table:
        raise ValueError(f"unknown all-reduce algorithm {name!r}; valid: {', '.join(ALGORITHMS)}")
    return table[name]


def bytes_sent(algorithm: str, numel: int, p: int, rank: int, element_size: int = 4,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Exact bytes group rank ``rank`` sends when ``algorithm`` all-reduces ``numel`` elements over ``p`` ranks.

    Ranks differ: in ``tree`` the folded pairs of a non-power-of-two ``p`` send
    a whole vector once each, and in ``chunked`` the segments of an ``numel``
    not divisible by ``p`` differ by one element.
    """
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is outside a group of {p}")
    if p == 1:
        return 0
    nbytes = numel * element_size
    if algorithm == "ring":
        return ring_allreduce_bytes(nbytes, p)
    if algorithm == "chunked":
        _ring_chunks(numel, p, element_size, chunk_bytes)  # same argument checks as the real run
        seg = [hi - lo for lo, hi in _split(0, numel, p)]
        return (2 * numel - seg[(rank + 1) % p] - seg[(rank + 2) % p]) * element_size
    if algorithm == "tree":
        p2, extra = _fold(p)
        folded = rank < 2 * extra
        if folded and rank % 2 == 0:
            return nbytes
        vrank = rank // 2 if folded else rank - extra
        # kept[i]: size of the range held after halving i. Halving i sends what it
        # gives away (kept[i-1] - kept[i]); the all-gather then sends kept[k], ..., kept[1].
        kept, lo, hi, d = [numel], 0, numel, p2 >> 1
        while d >= 1:
            mid = lo + (hi - lo) // 2
            lo, hi = (lo, mid) if vrank < vrank ^ d else (mid, hi)
            kept.append(hi - lo)
            d >>= 1
        elems = (numel - kept[-1]) + sum(kept[1:])
        return elems * element_size + (nbytes if folded else 0)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; valid: {', '.join(ALGORITHMS)}")

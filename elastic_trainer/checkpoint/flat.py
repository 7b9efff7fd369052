"""Shards whose tensors live in one reusable flat buffer per block.

A snapshot is taken every step, so what it costs is mostly overhead: a fresh
allocation per tensor (page faults on every new page) for the local copy, and
one object-store buffer per array when the part is written. Here a rank
copies its parameters and AdamW moments into a flat buffer it reuses once
nothing references it any more, laid out block by block, and the shard pickles
as one buffer per block (plus the small values: step counters, comm state).

A ``FlatShard`` is an ordinary shard dict (see ``state.py``) to every reader;
only its pickled form differs. Unpickled, its arrays are views into the
received buffers (read-only when they come from the object store).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from .dtypes import bits_dtype, numpy_dtype
from .host_arena import HostArena

_ALIGN = 64  # bytes: every array starts aligned, whatever the dtypes before it


class FlatShard(dict):
    """A shard dict whose ``params`` and flat optimizer moments are views into
    ``layout``'s buffers: ``{block: (uint8 buffer, [(name, kind, offset, dtype, shape)])}``
    with ``kind`` None for the parameter, else its optimizer-state key. Optimizer
    state that is not a tensor stays outside the buffers."""

    layout: dict

    def __reduce__(self):
        rest = {k: v for k, v in self.items() if k not in ("params", "optim")}
        flat = {(e[0], e[1]) for _, entries in self.layout.values() for e in entries}
        small = {n: {k: v for k, v in st.items() if (n, k) not in flat} for n, st in self["optim"].items()}
        return _rebuild, (rest, small, self.layout)


def flat_shard(shard: dict, layout: dict) -> FlatShard:
    """``shard`` as a ``FlatShard`` whose flat arrays are the views ``layout`` describes."""
    out = FlatShard(shard)
    out.layout = layout
    return out


def _entry_views(buf: np.ndarray, entries: list) -> list[np.ndarray]:
    """The arrays ``entries`` place in ``buf``, in order."""
    out = []
    for _, _, off, dtype, shape in entries:
        dt = np.dtype(dtype)
        out.append(buf[off:off + math.prod(shape) * dt.itemsize].view(dt).reshape(shape))
    return out


def _views(layout: dict) -> tuple[dict, dict]:
    params: dict = {}
    optim: dict = {}
    for buf, entries in layout.values():
        for (name, kind, *_), arr in zip(entries, _entry_views(buf, entries)):
            if kind is None:
                params[name] = arr
            else:
                optim.setdefault(name, {})[kind] = arr
    return params, optim


def _rebuild(rest: dict, small: dict, layout: dict) -> FlatShard:
    params, optim = _views(layout)
    for name, st in small.items():
        optim.setdefault(name, {}).update(st)
    return flat_shard(dict(rest, params=params, optim=optim), layout)


class _BlockBuffer:
    """One reusable buffer of a block, with the views and the layout entry every
    shard built on it shares (made once: rebuilding 100 views a step cost as much
    as the copy itself)."""

    def __init__(self, entries: list, nbytes: int, arena: HostArena):
        self.region = arena.take(nbytes)
        self.buf = self.region.array
        self.entries = entries
        self.layout = (self.buf, entries)
        self.views = _entry_views(self.buf, entries)
        self.tensors = [torch.from_numpy(v) for v in self.views]
        self._baseline = self._refcounts()

    def _refcounts(self) -> list[int]:
        return [sys.getrefcount(self.buf), sys.getrefcount(self.layout)] + [sys.getrefcount(v) for v in self.views]

    def free(self) -> bool:
        """Nothing outside this object holds the buffer, its layout entry or any of its views."""
        return self._refcounts() == self._baseline


class ShardExporter:
    """Copies one rank's state into flat buffers it reuses.

    A buffer is reused only when nothing outside the exporter still refers to
    it or to any array viewing it (reference counts say so), so a local copy
    kept for recovery, an array taken out of it, or a part still being written
    to the object store, is never overwritten.
    """

    def __init__(self, arena: HostArena | None = None, pinned: bool = False):
        """``arena``: where buffers come from (a worker's, kept across its re-plans); None: one
        of its own without a bound, page-locked where ``pinned``."""
        self.arena = arena if arena is not None else HostArena(None, pinned)
        self._pool: dict[int, list[_BlockBuffer]] = {}  # block -> its reusable buffers
        self.allocated = 0  # buffers made so far (a test reads it)

    @property
    def nbytes(self) -> int:
        """Host memory in buffers, in use or kept for reuse (the arena may hold more, free)."""
        return sum(b.buf.nbytes for pool in self._pool.values() for b in pool)

    def _drop(self, pool: list, buf: _BlockBuffer) -> None:
        pool.remove(buf)
        self.arena.give(buf.region)

    def sweep(self, keep: set[int]) -> None:
        """Give back the free buffers of blocks outside ``keep`` (a re-plan moved them away)."""
        for block, pool in self._pool.items():
            if block not in keep:
                for b in [b for b in pool if b.free()]:
                    self._drop(pool, b)

    def _buffer(self, block: int, entries: list, nbytes: int) -> _BlockBuffer:
        pool = self._pool.setdefault(block, [])
        free = [s for s in pool if s.free()]
        for s in free:
            if s.entries == entries:
                return s
        for s in free:  # the layout changed: a free buffer of another layout is no use
            self._drop(pool, s)
        buf = _BlockBuffer(entries, nbytes, self.arena)
        pool.append(buf)
        self.allocated += 1
        return buf

    def export(self, step: int, named_params, optimizer: torch.optim.Optimizer, blocks: list[int],
               block_of, extra: dict | None = None, comm: dict | None = None,
               comm_meta: dict | None = None, non_blocking: bool = False, ranges: dict | None = None) -> FlatShard:
        """Copy the live parameters and optimizer state into a ``FlatShard`` for ``step``.

        ``non_blocking``: device-to-host copies are queued on the current stream (into pinned
        buffers); the caller synchronises that stream before anyone reads the shard."""
        per_block: dict[int, list] = {}
        small: dict = {}
        for name, p in named_params:
            st = optimizer.state.get(p) or {}
            items = [(None, p)]
            for k, v in st.items():
                if torch.is_tensor(v):
                    items.append((k, v))
                else:
                    small.setdefault(name, {})[k] = np.asarray(v)
            per_block.setdefault(block_of(name), []).append((name, items))
        self.sweep(set(per_block))
        layout, dst, src = {}, [], []
        params: dict = {}
        optim: dict = small  # built above for this shard alone; the tensors' views join it
        for block, named in per_block.items():
            entries, off = [], 0
            for name, items in named:
                for kind, t in items:
                    bits = bits_dtype(t.dtype)
                    if bits is not t.dtype:  # bfloat16 travels as its bits (see dtypes.py)
                        t = t.detach().view(bits)
                    dt = numpy_dtype(t.dtype, name)
                    entries.append((name, kind, off, dt.str, tuple(t.shape)))
                    off += -(-t.numel() * dt.itemsize // _ALIGN) * _ALIGN
                    src.append(t)
            buf = self._buffer(block, entries, off)
            layout[block] = buf.layout
            dst.extend(buf.tensors)
            for (name, kind, *_), view in zip(entries, buf.views):
                if kind is None:
                    params[name] = view
                else:
                    optim.setdefault(name, {})[kind] = view
        with torch.no_grad():
            for d, t in zip(dst, src):
                d.copy_(t, non_blocking=non_blocking)
        shard = {"step": step, "blocks": sorted(blocks), "extra": extra or {}, "comm": comm or {},
                 "comm_meta": comm_meta or {}, "params": params, "optim": optim}
        if ranges:
            shard["ranges"] = ranges   # a sharded optimizer's slices (see state.py)
        return flat_shard(shard, layout)

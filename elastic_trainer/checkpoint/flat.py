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


def _views(layout: dict) -> tuple[dict, dict]:
    params: dict = {}
    optim: dict = {}
    for buf, entries in layout.values():
        for name, kind, off, dtype, shape in entries:
            dt = np.dtype(dtype)
            n = math.prod(shape) * dt.itemsize
            arr = buf[off:off + n].view(dt).reshape(shape)
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


class ShardExporter:
    """Copies one rank's state into flat buffers it reuses.

    A buffer is reused only when no array anywhere still views it (its
    reference count says so), so a local copy kept for recovery, or a part
    still being written to the object store, is never overwritten.
    """

    def __init__(self):
        self._pool: dict[int, list[np.ndarray]] = {}  # block -> buffers
        self.allocated = 0  # buffers made so far (a test reads it)

    def _buffer(self, block: int, nbytes: int) -> np.ndarray:
        pool = self._pool.setdefault(block, [])
        # Free: referenced only by the pool list (and getrefcount's argument).
        free = [i for i in range(len(pool)) if sys.getrefcount(pool[i]) == 2]
        for i in free:
            if pool[i].nbytes == nbytes:
                return pool[i]
        for i in reversed(free):  # the layout changed: a free buffer of another size is no use
            del pool[i]
        buf = np.empty(nbytes, dtype=np.uint8)
        pool.append(buf)
        self.allocated += 1
        return buf

    def export(self, step: int, named_params, optimizer: torch.optim.Optimizer, blocks: list[int],
               block_of, extra: dict | None = None, comm: dict | None = None,
               comm_meta: dict | None = None) -> FlatShard:
        """Copy the live parameters and optimizer state into a ``FlatShard`` for ``step``."""
        per_block: dict[int, list] = {}
        small: dict = {}
        for name, p in named_params:
            st = optimizer.state.get(p) or {}
            items = [(None, p)] + [(k, v) for k, v in st.items() if torch.is_tensor(v)]
            per_block.setdefault(block_of(name), []).append((name, items))
            rest = {k: np.asarray(v) for k, v in st.items() if not torch.is_tensor(v)}
            if rest:
                small[name] = rest
        layout, src = {}, []
        for block, named in per_block.items():
            entries, off = [], 0
            for name, items in named:
                for kind, t in items:
                    dt = _numpy_dtype(t.dtype, name)
                    entries.append((name, kind, off, dt.str, tuple(t.shape)))
                    off += -(-t.numel() * dt.itemsize // _ALIGN) * _ALIGN
                    src.append(t.detach())
            layout[block] = (self._buffer(block, off), entries)
        out = _rebuild({"step": step, "blocks": sorted(blocks), "extra": extra or {}, "comm": comm or {},
                        "comm_meta": comm_meta or {}}, small, layout)
        with torch.no_grad():
            for (name, kind, *_), t in zip((e for _, entries in layout.values() for e in entries), src):
                torch.from_numpy(out["params"][name] if kind is None else out["optim"][name][kind]).copy_(t)
        return out


_DTYPES: dict = {}


def _numpy_dtype(dtype: torch.dtype, name: str) -> np.dtype:
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    try:
        return _DTYPES.setdefault(dtype, torch.empty((), dtype=dtype).numpy().dtype)
    except TypeError as e:
        raise TypeError(f"{name}: {dtype} has no numpy equivalent; snapshots hold numpy arrays "
                        f"(float32, float16, float64 work)") from e

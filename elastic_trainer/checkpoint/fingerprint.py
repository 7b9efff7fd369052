"""Fingerprints of training state that do not depend on the layout, to check a restore bit for bit.

A tensor's fingerprint is a sum, modulo 2**64, of a mix of each element's bits with its index in
the flattened tensor. A sum over disjoint ranges is the sum over their union, so the slices of
a sharded optimizer's ranks add up to the whole tensor's fingerprint: a state saved under one
sharding and restored under another compares tensor by tensor without being put together
anywhere. Numbers (AdamW's ``step``) are kept as they are; they are the same in every slice.

With ``checkpoint.verify_restores`` each snapshot part carries its fingerprint
(``part_fingerprint``); a restoring rank adds up those of the parts it read (``saved``) and
fingerprints what it then holds (``held``), and the controller compares the two for each stage
(``controller.restore_check``).
"""

from __future__ import annotations

import uuid

import numpy as np

from .dtypes import to_numpy
from .slices import range_of

_MASK = (1 << 64) - 1
_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xC2B2AE3D27D4EB4F)
_K3 = np.uint64(0x165667B19E3779F9)
_CHUNK = 1 << 20   # elements a pass: its uint64 scratch stays a few MB whatever the tensor


def range_fingerprint(arr, start: int) -> int:
    """Fingerprint of ``arr`` as the flat elements ``[start, start + arr.size)`` of a tensor."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    bits = flat.view(f"u{flat.itemsize}")
    total = 0
    for a in range(0, flat.size, _CHUNK):
        h = bits[a:a + _CHUNK].astype(np.uint64)
        h = (h * _K3 + np.arange(start + a, start + a + h.size, dtype=np.uint64)) * _K1
        h ^= h >> np.uint64(29)
        h *= _K2
        total = (total + int(h.sum(dtype=np.uint64))) & _MASK
    return total


def part_fingerprint(shard: dict) -> dict:
    """``{"id", "tensors": {"name|kind": int or number}, "sliced": names held as slices}`` of a
    snapshot part (``kind``: ``param`` or an optimizer-state key)."""
    out = {}
    for n, p in shard["params"].items():
        out[f"{n}|param"] = range_fingerprint(p, range_of(shard, n)[0])
        for k, v in (shard["optim"].get(n) or {}).items():
            out[f"{n}|{k}"] = (float(np.asarray(v)) if np.ndim(v) == 0
                               else range_fingerprint(v, range_of(shard, n, optim=True)[0]))
    return {"id": uuid.uuid4().hex, "tensors": out, "sliced": sorted(shard.get("ranges") or {})}


def saved_fingerprint(shards: list[dict], names: list[str]) -> dict[str, int | float]:
    """What the parts a rank read held of ``names``, by ``name|kind``: a name one part holds whole
    is that part's; a sliced one, the sum over the distinct parts holding slices of it. Names no
    part fingerprinted (a durable checkpoint's) are left out."""
    parts = {}
    for s in shards:
        fp = s.get("fingerprint")
        if fp:
            parts.setdefault(fp["id"], fp)
    want = set(names)
    whole: dict = {}
    summed: dict = {}
    for fp in parts.values():
        sliced = set(fp["sliced"])
        for key, v in fp["tensors"].items():
            name = key.rsplit("|", 1)[0]
            if name not in want:
                continue
            if name not in sliced or isinstance(v, float):
                whole.setdefault(key, v)
            else:
                summed[key] = (summed.get(key, 0) + v) & _MASK
    return {**summed, **whole}


def held_fingerprint(named_params, optimizer, owned: dict | None) -> dict[str, int | float]:
    """What a rank holds, by ``name|kind``: its parameters whole, and the moments it owns
    (``owned``: name -> (tensor the optimizer steps, start in the flattened parameter), a sharded
    optimizer's; None: each parameter's own state, whole)."""
    out: dict = {}
    for n, p in named_params:
        out[f"{n}|param"] = range_fingerprint(to_numpy(p, p.device.type != "cpu"), 0)
        key, start = (p, 0) if owned is None else owned.get(n, (None, 0))
        state = optimizer.state.get(key) if key is not None else None
        for k, v in (state or {}).items():
            out[f"{n}|{k}"] = float(v) if v.ndim == 0 else range_fingerprint(to_numpy(v, v.device.type != "cpu"), start)
    return out


def add(a: int, b: int) -> int:
    """Two fingerprints' sum: that of the union of their disjoint ranges."""
    return (a + b) & _MASK

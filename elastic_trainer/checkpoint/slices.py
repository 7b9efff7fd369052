"""Slices of parameters a sharded optimizer's ranks hold: cut to what a restoring rank needs, and put
back together.

A shard with ``ranges`` (name -> ``[start, end, shape]``) holds, for those names, the flat
elements ``[start, end)`` of the parameter and of its moments. A shard cut for one reader
(``worker.snapshot_serving.cut_for_reader``, through ``cut_moments``) may hold fewer elements of the moments than of the parameter: its
``optim_ranges`` (same form) gives the moments' range where it differs. Every replica of a
stage holds its weights whole, but a sharded rank owns the moments of 1/dp of them, so a
restore moves whole weights and only the moments' ranges that change owner. Pure numpy.
"""

from __future__ import annotations

import math

import numpy as np


def _shape(shard: dict, name: str) -> list[int]:
    r = (shard.get("ranges") or {}).get(name)
    return list(r[2]) if r else list(np.shape(shard["params"][name]))


def range_of(shard: dict, name: str, optim: bool = False) -> tuple[int, int]:
    """``[start, end)`` of the flattened parameter that ``shard`` holds of ``name`` (``optim``: of its moments)."""
    r = (shard.get("optim_ranges") or {}).get(name) if optim else None
    r = r or (shard.get("ranges") or {}).get(name)
    return (int(r[0]), int(r[1])) if r else (0, int(np.size(shard["params"][name])))


def cut_moments(part: dict, owned: dict[str, tuple[int, int]]) -> dict:
    """``part`` (already cut to the reader's blocks) with each name's moments cut to the reader's
    ``owned`` range of it (name -> ``(start, end)`` of the flattened parameter): a plain dict whose
    arrays are views of ``part``'s. A name the reader owns none of keeps no moments; the parameters
    stay as they are."""
    optim, oranges = {}, {}
    for n, st in part["optim"].items():
        if n not in owned:
            continue
        s, e = range_of(part, n, optim=True)
        a, z = max(s, owned[n][0]), min(e, owned[n][1])
        if a >= z:
            continue
        optim[n] = {k: (v if np.ndim(v) == 0 else np.asarray(v).reshape(-1)[a - s:z - s]) for k, v in st.items()}
        oranges[n] = [a, z, _shape(part, n)]
    out = {k: v for k, v in part.items() if k not in ("optim", "optim_ranges")}
    out["params"] = dict(part["params"])
    out["optim"], out["optim_ranges"] = optim, oranges
    return out


def gather_range(name: str, pieces: list, lo: int, hi: int, what: str) -> dict:
    """Elements ``[lo, hi)`` of each array of ``name`` from ``pieces`` = ``((start, end), {key: flat array
    or number})`` (a number, AdamW's ``step``, is the same in every piece). Error if the pieces leave
    part of ``[lo, hi)`` out (``what`` names the arrays for it)."""
    for (s, e), arrays in pieces:
        if (s, e) == (lo, hi):   # one piece is all of it (a whole shard's): no copy
            return {k: (np.asarray(v) if np.ndim(v) == 0 else np.asarray(v).reshape(-1)) for k, v in arrays.items()}
    covered = np.zeros(hi - lo, dtype=bool)
    out: dict = {}
    for (s, e), arrays in pieces:
        a, z = max(s, lo), min(e, hi)
        if a >= z:
            continue
        covered[a - lo:z - lo] = True
        for k, v in arrays.items():
            v = np.asarray(v)
            if v.ndim == 0:
                out.setdefault(k, v)
                continue
            if k not in out:
                out[k] = np.empty(hi - lo, dtype=v.dtype)
            out[k][a - lo:z - lo] = v.reshape(-1)[a - s:z - s]
    if not covered.all():
        gap = lo + int(np.argmin(covered))
        raise ValueError(f"{name}: the slices given hold {int(covered.sum())} of the {hi - lo} elements "
                         f"[{lo}, {hi}) of its {what} (none from element {gap}): a shard of its sharded "
                         "optimizer is missing")
    return out


def assemble_param(name: str, pieces: list) -> np.ndarray:
    """One parameter, whole, from its slices ``(range, flat slice)`` (``range``: ``[start, end, shape]``)."""
    shape = tuple(pieces[0][0][2])
    return gather_range(name, [((r[0], r[1]), {"p": a}) for r, a in pieces], 0, math.prod(shape),
                        "parameter")["p"].reshape(shape)


def merge_moments(shards: list[dict], name: str, lo: int, hi: int) -> dict:
    """``name``'s moments over ``[lo, hi)`` of the flattened parameter, from whichever shards hold
    them (whole or sliced); {} where no shard holds any (a parameter not yet stepped)."""
    pieces = [(range_of(s, name, optim=True), s["optim"][name]) for s in shards if name in s["optim"]]
    return gather_range(name, pieces, lo, hi, "moments") if pieces else {}

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


class Assembled(np.ndarray):
    """An array put together here from slices: new memory that nothing else holds, so a load takes
    it as it is (``owned_array``) instead of copying it once more."""


def owned_array(v) -> np.ndarray:
    """``v`` as an array the caller may keep and write: an ``Assembled`` one as it is, any other
    copied (an object-store array is read-only, and a local copy's buffers are reused by the next
    snapshot)."""
    return np.asarray(v).view(np.ndarray) if isinstance(v, Assembled) else np.array(v)


def check_cover(name: str, spans: list[tuple[int, int]], lo: int, hi: int, what: str) -> None:
    """Error unless the ``[start, end)`` ``spans`` cover ``[lo, hi)`` (``what`` names the arrays for it)."""
    covered = np.zeros(hi - lo, dtype=bool)
    for s, e in spans:
        a, z = max(s, lo), min(e, hi)
        if a < z:
            covered[a - lo:z - lo] = True
    if not covered.all():
        gap = lo + int(np.argmin(covered))
        raise ValueError(f"{name}: the slices given hold {int(covered.sum())} of the {hi - lo} elements "
                         f"[{lo}, {hi}) of its {what} (none from element {gap}): a shard of its sharded "
                         "optimizer is missing")


def gather_range(name: str, pieces: list, lo: int, hi: int, what: str) -> dict:
    """Elements ``[lo, hi)`` of each array of ``name`` from ``pieces`` = ``((start, end), {key: flat array
    or number})`` (a number, AdamW's ``step``, is the same in every piece). Error if the pieces leave
    part of ``[lo, hi)`` out (``what`` names the arrays for it). Arrays put together from several
    pieces are ``Assembled`` and flat; one piece that is all of it comes as held (of the
    parameter's shape, or an optimizer's own, such as Adafactor's factors)."""
    for (s, e), arrays in pieces:
        if (s, e) == (lo, hi):   # one piece is all of it (a whole shard's): no copy, shapes as held
            return {k: np.asarray(v) for k, v in arrays.items()}
    check_cover(name, [span for span, _ in pieces], lo, hi, what)
    for (s, e), arrays in pieces:
        odd = [k for k, v in arrays.items() if np.ndim(v) and np.size(v) != e - s]
        if odd:
            raise ValueError(f"{name}: its {what} {odd} are not of the parameter's size (an optimizer that is "
                             f"not elementwise) and cannot be put together from slices [{s}, {e})")
    out: dict = {}
    for (s, e), arrays in pieces:
        a, z = max(s, lo), min(e, hi)
        if a >= z:
            continue
        for k, v in arrays.items():
            v = np.asarray(v)
            if v.ndim == 0:
                out.setdefault(k, v)
                continue
            if k not in out:
                out[k] = np.empty(hi - lo, dtype=v.dtype).view(Assembled)
            out[k][a - lo:z - lo] = v.reshape(-1)[a - s:z - s]
    return out


class Pieces:
    """A parameter's slices not put together: ``shape``, and ``pieces`` = ``[((start, end), flat
    array)]`` that cover it (checked). A load writes each piece where it belongs in the live
    tensor (``state.load_into``): one copy, where putting it together first would be two."""

    def __init__(self, name: str, pieces: list):
        self.shape = tuple(pieces[0][0][2])
        self.pieces = [((int(r[0]), int(r[1])), np.asarray(a).reshape(-1)) for r, a in pieces]
        check_cover(name, [span for span, _ in self.pieces], 0, self.size, "parameter")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def whole(self) -> np.ndarray:
        """The parameter put together (new memory)."""
        out = np.empty(self.size, dtype=self.pieces[0][1].dtype)
        for (s, e), a in self.pieces:
            out[s:e] = a
        return out.reshape(self.shape)


def assemble_param(name: str, pieces: list) -> np.ndarray:
    """One parameter, whole, from its slices ``(range, flat slice)`` (``range``: ``[start, end, shape]``)."""
    return Pieces(name, pieces).whole()


def merge_moments(shards: list[dict], name: str, lo: int, hi: int) -> dict:
    """``name``'s moments over ``[lo, hi)`` of the flattened parameter, from whichever shards hold
    them (whole or sliced); {} where no shard holds any (a parameter not yet stepped)."""
    pieces = [(range_of(s, name, optim=True), s["optim"][name]) for s in shards if name in s["optim"]]
    return gather_range(name, pieces, lo, hi, "moments") if pieces else {}

"""Layout-free training state: every tensor keyed by its global parameter name.

A shard is one rank's state at one step, as plain dicts of numpy arrays so the
Ray object store can hold it and readers map it without copying:

    {"step": int, "blocks": [block indices],
     "params": {name: array}, "optim": {name: {"exp_avg": .., "exp_avg_sq": .., "step": ..}},
     "extra": {...}}

``optim`` holds whatever ``optimizer.state[p]`` holds, by key (any torch.optim class or a
user's): tensors of the parameter's shape, scalar counters, and, of an optimizer that is not
elementwise (Adafactor's row and column factors), tensors of other shapes, carried whole
(such an optimizer never runs sharded, so they are never sliced).

Any set of shards from one step that covers every block restores into any
dp x pp: a rank takes the names of its own blocks from whichever shard has them.

Two more sections carry the communication layer's state: ``comm`` (by
parameter name, like ``optim``: error-feedback residuals, DiLoCo's outer
parameters and momentum) and ``comm_meta`` (the codec, the replica and dp that
wrote it, PowerSGD's per-bucket matrices). Residuals belong to one replica.

A rank of a sharded optimizer (``parallel.shard_optimizer``) holds a slice of
some parameters: its shard has ``ranges`` (name -> ``[start, end, shape]``),
and those names' parameter and moments are the flat elements
``[start, end)`` of the parameter of that shape. ``merge_shards`` puts the
slices of a step back together, whatever sharding wrote them.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from .dtypes import as_tensor, to_numpy
from .flat import FlatShard, flat_shard
from .optim_state import state_tensors
from .slices import Pieces, assemble_param, merge_moments


def block_of(name: str) -> int:
    """Block index of a global parameter name ``blocks.<index>.<rest>``."""
    return int(name.split(".", 2)[1])


def export_shard(step: int, named_params, optimizer: torch.optim.Optimizer, blocks: list[int],
                 extra: dict | None = None, comm: dict | None = None, comm_meta: dict | None = None,
                 copy: bool = True, loan=None, ranges: dict | None = None) -> dict:
    """One rank's parameters and optimizer state: copied out of the live tensors, or with
    ``copy=False`` (CPU tensors only) as views of them, valid until they next change, or
    as views lent by ``loan`` (a ``tensor_loan.TensorLoan``), which says when no reader holds them.
    ``ranges``: the slices a sharded optimizer's rank holds (see the module docstring)."""
    def as_numpy(t):
        return loan.view(t) if loan is not None else to_numpy(t, copy)

    params, optim = {}, {}
    for name, p in named_params:
        params[name] = as_numpy(p)
        st = optimizer.state.get(p)
        if st:
            optim[name] = {k: as_numpy(v) if torch.is_tensor(v) else np.asarray(v) for k, v in st.items()}
    out = {"step": step, "blocks": sorted(blocks), "params": params, "optim": optim, "extra": extra or {},
           "comm": comm or {}, "comm_meta": comm_meta or {}}
    if ranges:
        out["ranges"] = ranges
    return out


def pick_comm(shards: list[dict], names, own_residuals) -> tuple[dict, dict]:
    """Comm state for ``names`` from shards of one step: ``({name: {kind: array}}, buckets)``.

    Residuals are taken only from shards for which ``own_residuals(comm_meta)``
    holds (written by this replica, under the same dp and codec); the other
    kinds (DiLoCo's outer state) are the same on every replica.
    """
    out: dict = {}
    buckets: dict = {}
    for s in shards:
        meta = s.get("comm_meta") or {}
        mine = own_residuals(meta)
        for n in names:
            for kind, value in (s.get("comm") or {}).get(n, {}).items():
                if kind == "residual" and not mine:
                    continue
                out.setdefault(n, {}).setdefault(kind, value)
        for sig, extras in (meta.get("buckets") or {}).items():
            buckets.setdefault(sig, extras)
    return out, buckets


def select_blocks(shard: dict, blocks) -> dict:
    """The part of ``shard`` that holds ``blocks`` (no copy: the arrays are shared)."""
    want = set(blocks)
    keep = [n for n in shard["params"] if block_of(n) in want]
    comm = shard.get("comm") or {}
    out = {"step": shard["step"], "blocks": sorted(want & set(shard["blocks"])),
           "params": {n: shard["params"][n] for n in keep},
           "optim": {n: shard["optim"][n] for n in keep if n in shard["optim"]}, "extra": shard["extra"],
           "comm": {n: comm[n] for n in keep if n in comm}, "comm_meta": shard.get("comm_meta") or {}}
    ranges = shard.get("ranges") or {}
    if ranges:
        out["ranges"] = {n: ranges[n] for n in keep if n in ranges}
    if shard.get("fingerprint"):
        out["fingerprint"] = shard["fingerprint"]   # the whole part's: a reader takes its own names
    if isinstance(shard, FlatShard):
        return flat_shard(out, {b: v for b, v in shard.layout.items() if b in want})
    return out


def merge_shards(shards: list[dict], names: list[str], owned: dict[str, tuple[int, int]] | None = None,
                 pieces: bool = False) -> tuple[int, dict, dict]:
    """Pick ``names`` out of shards of one step: each parameter whole (held whole by a shard, else put
    together from the slices of sharded ones), with its moments. ``owned`` (name -> ``(start, end)``
    of the flattened parameter): the reader is a rank of a sharded optimizer, whose moments are
    those ranges only, as flat arrays, and none for other names. ``pieces``: a sliced parameter
    comes as its ``Pieces``, for ``load_into`` to write in place. Error if the step differs, a
    name is missing, or its slices leave part of it out."""
    steps = {s["step"] for s in shards}
    if len(steps) > 1:
        raise ValueError(f"refusing to mix states from steps {sorted(steps)}")
    params, optim, missing = {}, {}, []
    for n in names:
        holders = [s for s in shards if n in s["params"]]
        whole = next((s for s in holders if n not in (s.get("ranges") or {})), None)
        if whole is not None:
            params[n] = whole["params"][n]
        elif holders:
            sliced = [(s["ranges"][n], s["params"][n]) for s in holders]
            params[n] = Pieces(n, sliced) if pieces else assemble_param(n, sliced)
        else:
            missing.append(n)
            continue
        if owned is None:
            shape = tuple(params[n].shape)
            # Entries of the parameter's size are its shape; others (Adafactor's factors) keep their own.
            st = {k: (v.reshape(shape) if v.ndim and v.size == math.prod(shape) else v)
                  for k, v in merge_moments(shards, n, 0, math.prod(shape)).items()}
        else:
            st = merge_moments(shards, n, *owned[n]) if n in owned else {}
        if st:
            optim[n] = st
    if missing:
        raise ValueError(f"{len(missing)} parameters missing from the shards given, e.g. {missing[:3]}")
    return steps.pop(), params, optim


def step_placement(device: torch.device, group: dict) -> tuple[torch.dtype, torch.device]:
    """(dtype, device) of the ``step`` torch's Adam/AdamW keeps for a parameter on ``device`` in
    param group ``group``, as its ``_init_group`` makes it.

    Capturable or fused: float32 (the default scalar dtype if only capturable) on the parameter's
    device, where the graph or fused kernel reads it. Otherwise a CPU tensor of the default scalar
    dtype (float32, float64 under a float64 default): the update reads it as a number for the bias
    correction, which from a GPU tensor would wait on the device once per parameter each step.
    """
    fused = bool(group.get("fused"))
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 and not fused else torch.float32
    if fused or group.get("capturable"):
        return scalar, torch.device(device)
    return scalar, torch.device("cpu")


def step_tensor(value, device: torch.device, group: dict) -> torch.Tensor:
    # Whatever form the shard holds it in (a float32 array, a plain number), it comes back as torch holds it.
    dtype, where = step_placement(device, group)
    return torch.from_numpy(np.array(value, dtype=np.float64).reshape(())).to(dtype=dtype, device=where)


def load_into(named_params, optimizer: torch.optim.Optimizer, params: dict, optim: dict) -> None:
    """Write parameters and optimizer state into the live tensors (shapes checked); each state
    entry is held as the optimizer itself holds it (``optim_state.state_tensors``)."""
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    named_params = list(named_params)
    for name, p in named_params:
        src = params[name]
        if tuple(src.shape) != tuple(p.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(p.shape)}")
    with torch.no_grad():
        for name, p in named_params:
            src = params[name]
            with warnings.catch_warnings():
                # Object-store arrays are read-only; they are only read here.
                warnings.simplefilter("ignore", UserWarning)
                if isinstance(src, Pieces) and p.is_contiguous():
                    flat = p.view(-1)   # a sharded optimizer's slices, each written where it belongs
                    for (s, e), a in src.pieces:
                        flat[s:e].copy_(as_tensor(a, p.dtype))
                elif isinstance(src, Pieces):
                    p.copy_(as_tensor(src.whole(), p.dtype))
                else:
                    p.copy_(as_tensor(src, p.dtype))
            if name in optim:
                optimizer.state[p] = state_tensors(optimizer, groups.get(id(p), {}), p, optim[name])
            else:
                optimizer.state.pop(p, None)


def shard_nbytes(shard: dict) -> int:
    n = sum(a.nbytes for a in shard["params"].values())
    n += sum(a.nbytes for st in shard["optim"].values() for a in st.values())
    return n + sum(np.asarray(a).nbytes for st in (shard.get("comm") or {}).values() for a in st.values())

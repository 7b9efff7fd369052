"""Layout-free training state: every tensor keyed by its global parameter name.

A shard is one rank's state at one step, as plain dicts of numpy arrays so the
Ray object store can hold it and readers map it without copying:

    {"step": int, "blocks": [block indices],
     "params": {name: array}, "optim": {name: {"exp_avg": .., "exp_avg_sq": .., "step": ..}},
     "extra": {...}}

Any set of shards from one step that covers every block restores into any
dp x pp: a rank takes the names of its own blocks from whichever shard has them.
"""

from __future__ import annotations

import numpy as np
import torch


def block_of(name: str) -> int:
    """Block index of a global parameter name ``blocks.<index>.<rest>``."""
    return int(name.split(".", 2)[1])


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", copy=True).numpy()


def export_shard(step: int, named_params, optimizer: torch.optim.Optimizer, blocks: list[int],
                 extra: dict | None = None) -> dict:
    """Copy one rank's parameters and optimizer state out of the live tensors."""
    params, optim = {}, {}
    for name, p in named_params:
        params[name] = to_numpy(p)
        st = optimizer.state.get(p)
        if st:
            optim[name] = {k: to_numpy(v) if torch.is_tensor(v) else np.asarray(v) for k, v in st.items()}
    return {"step": step, "blocks": sorted(blocks), "params": params, "optim": optim, "extra": extra or {}}


def merge_shards(shards: list[dict], names: list[str]) -> tuple[int, dict, dict]:
    """Pick ``names`` out of shards of one step; error if the step differs or a name is missing."""
    steps = {s["step"] for s in shards}
    if len(steps) > 1:
        raise ValueError(f"refusing to mix states from steps {sorted(steps)}")
    params, optim = {}, {}
    for s in shards:
        for n in names:
            if n in s["params"] and n not in params:
                params[n] = s["params"][n]
                if n in s["optim"]:
                    optim[n] = s["optim"][n]
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"{len(missing)} parameters missing from the shards given, e.g. {missing[:3]}")
    return steps.pop(), params, optim


def load_into(named_params, optimizer: torch.optim.Optimizer, params: dict, optim: dict) -> None:
    """Write parameters and optimizer state into the live tensors (shapes checked)."""
    with torch.no_grad():
        for name, p in named_params:
            src = params[name]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(p.shape)}")
            p.copy_(torch.from_numpy(np.ascontiguousarray(src)))
            if name in optim:
                optimizer.state[p] = {
                    k: torch.tensor(v, device=p.device) if k == "step" else
                    torch.from_numpy(np.array(v)).to(p.device)
                    for k, v in optim[name].items()
                }
            else:
                optimizer.state.pop(p, None)


def shard_nbytes(shard: dict) -> int:
    n = sum(a.nbytes for a in shard["params"].values())
    return n + sum(a.nbytes for st in shard["optim"].values() for a in st.values())

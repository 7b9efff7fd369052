"""Building a rank's blocks: from the run's seed at the start, and at a restore only what the rank lacks.

At the start a rank builds its own blocks and nothing else (``models.build``):
each module is initialised from a seed of its own, so every layout, and a
single-process run, starts from the same model. At a restore
the weights come from a snapshot, so initialising them is wasted work (at
40 M parameters it was most of the restore): the blocks a rank already held
are kept as they are, and the ones it gains are built on the meta device
(shapes only) and given uninitialised memory, which the load then fills.

Snapshots hold parameters and optimizer state, not buffers, so a block
gained with buffers (a causal mask, running statistics) is built for real;
so is everything when the factory cannot build on the meta device.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..config import ModelSection
from ..models.build import build_own_blocks
from ..models.factory import build_blocks_for_shapes
from ..models.hf import block_ties
from .setup_progress import PROGRESS


def _has_state_outside_params(m) -> bool:
    return isinstance(m, nn.Module) and any(True for _ in m.buffers())


def build_rank_blocks(model: ModelSection, seed: int, own: list[int], device: torch.device,
                      restoring: bool, held: dict[int, nn.Module] | None = None
                      ) -> tuple[dict[int, nn.Module], Callable, dict]:
    """This rank's blocks on ``device`` and the loss, plus what was done: ``{"reused": [..],
    "built": [..], "init": "seed" | "load" | "factory-part" | "whole" | "empty", "ties": [(leader,
    follower) global names], "files": [weight files read]}``. ``held``: blocks of the rank's previous
    plan, still on ``device``, reused when ``restoring`` (their values are overwritten by the load)."""
    held = held if restoring and held else {}
    need = [i for i in own if i not in held]
    if not restoring:
        blocks, loss_fn, ties, how = build_own_blocks(model, seed, own, device, on_block=PROGRESS.tick)
        return blocks, loss_fn, {"reused": [], "built": list(own), "init": how["how"], "ties": ties,
                                 "files": how.get("files", [])}
    blocks, loss_fn, on_meta = build_blocks_for_shapes(model, seed)
    if not on_meta or _has_state_outside_params(loss_fn) or any(_has_state_outside_params(blocks[i]) for i in need):
        if on_meta:
            out, loss_fn, _, how = build_own_blocks(model, seed, need, device, on_block=PROGRESS.tick)
            init = how["how"]
        else:
            out, init = {i: blocks[i].to(device) for i in need}, "whole"
    else:
        init = "empty"
        out = {i: blocks[i].to_empty(device=device) for i in need}
    out.update({i: held[i] for i in own if i in held})
    return out, loss_fn, {"reused": sorted(held.keys() & set(own)), "built": need, "init": init,
                          "ties": block_ties(blocks)}

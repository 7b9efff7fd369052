"""How a block's forward runs: under autocast (``train.precision``) and with activation
checkpointing (``train.activation_checkpointing``).

Both wrap each block's own ``forward`` in place, so parameter names (and so
snapshots, checkpoints and the planner's view of the model) do not change,
and every schedule, pipelined or not, runs the same per-block code. Autocast
covers forward only: backward runs in the dtypes forward chose, as torch's
autocast guide asks. The loss runs under the same autocast, so its
reductions get autocast's fp32 policy (cross-entropy of bf16 logits is
computed in fp32).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _device_type(args) -> str:
    for a in args:
        if torch.is_tensor(a):
            return a.device.type
    return "cpu"


def autocast_call(fn, dtype: torch.dtype | None):
    """``fn`` run under autocast to ``dtype`` on its inputs' device type (``fn`` itself when None)."""
    if dtype is None:
        return fn

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.autocast(_device_type(args), dtype=dtype):
            return fn(*args, **kwargs)

    return run


def wrap_block(block: nn.Module, precision: str, checkpointing: str) -> nn.Module:
    """Make ``block``'s forward autocast and/or checkpointed, in place; returns ``block``."""
    if precision not in AUTOCAST_DTYPES:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(AUTOCAST_DTYPES)}")
    if checkpointing not in ("none", "blocks"):
        raise ValueError(f"activation_checkpointing {checkpointing!r} is not 'none' or 'blocks'")
    fn = autocast_call(block.forward, AUTOCAST_DTYPES[precision])
    if checkpointing == "blocks":
        inner = fn

        def fn(*args, **kwargs):
            # Non-reentrant: works with inputs that need no grad (token ids) and keeps the
            # RNG and autocast state of forward for the recompute.
            return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    if fn is not block.forward:
        block.forward = fn
    return block

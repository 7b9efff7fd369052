"""Build a model from the config: the built-in GPT or a user's import path."""

from __future__ import annotations

import importlib
from typing import Callable

import torch
from torch import nn

from ..config import ModelSection
from ..errors import ModelError
from .gpt import build_gpt


def resolve_factory(model: ModelSection) -> Callable[..., tuple[list[nn.Module], Callable]]:
    """Import the factory named by ``model.factory`` (or the GPT builder)."""
    if model.kind == "gpt":
        return build_gpt
    module_name, _, fn_name = model.factory.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or any error raised while importing
        raise ModelError(f"model.factory({model.factory!r}): cannot import {module_name!r}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ModelError(f"model.factory({model.factory!r}): module {module_name!r} has no callable {fn_name!r}")
    return fn


def build_blocks(model: ModelSection, seed: int) -> tuple[list[nn.Module], Callable]:
    """Build every block with the run's seed, so each rank sees identical initial weights."""
    fn = resolve_factory(model)
    kwargs = (
        dict(n_layer=model.n_layer, n_head=model.n_head, d_model=model.d_model,
             seq_len=model.seq_len, vocab_size=model.vocab_size, dropout=model.dropout)
        if model.kind == "gpt" else dict(model.kwargs)
    )
    torch.manual_seed(seed)
    try:
        out = fn(**kwargs)
    except Exception as e:
        raise ModelError(f"model factory {model.factory or 'gpt'} failed with kwargs {kwargs}: {e!r}") from e
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ModelError(f"model factory {model.factory} must return (blocks, loss_fn), got {type(out).__name__}")
    blocks, loss_fn = out
    blocks = list(blocks)
    bad = [i for i, b in enumerate(blocks) if not isinstance(b, nn.Module)]
    if not blocks or bad:
        raise ModelError(
            f"model factory {model.factory} must return a non-empty list of nn.Module blocks; "
            f"got {len(blocks)} blocks, not modules at {bad}"
        )
    if not callable(loss_fn):
        raise ModelError(f"model factory {model.factory}: loss_fn {loss_fn!r} is not callable")
    return blocks, loss_fn


def block_param_counts(model: ModelSection) -> list[int]:
    """Parameter count per block, built on the meta device so nothing is allocated."""
    with torch.device("meta"):
        blocks, _ = build_blocks(model, seed=0)
    return [sum(p.numel() for p in b.parameters()) for b in blocks]

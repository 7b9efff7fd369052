"""Build a model from the config: the built-in GPT or a user's import path."""

from __future__ import annotations

import importlib
import logging
from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..config import ModelSection
from ..errors import ModelError
from .gpt import build_gpt
from .hf import build_hf_blocks

log = logging.getLogger(__name__)


def resolve_factory(model: ModelSection) -> Callable[..., tuple[list[nn.Module], Callable]]:
    """Import the factory named by ``model.factory`` (or the GPT builder)."""
    if model.kind == "gpt":
        return build_gpt
    if model.kind == "hf":
        return build_hf_blocks
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
    if model.kind == "gpt":
        kwargs = dict(n_layer=model.n_layer, n_head=model.n_head, d_model=model.d_model,
                      seq_len=model.seq_len, vocab_size=model.vocab_size, dropout=model.dropout)
    elif model.kind == "hf":
        kwargs = dict(hf_config=model.hf_config, init_from=model.init_from)
    else:
        kwargs = dict(model.kwargs)
    torch.manual_seed(seed)
    try:
        out = fn(**kwargs)
    except ModelError:
        raise
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


# In-place initialisers that give a meta tensor nothing but its own shape back.
_INIT_METHODS = frozenset(getattr(torch.Tensor, n) for n in (
    "normal_", "uniform_", "erfinv_", "log_normal_", "exponential_", "cauchy_", "geometric_", "bernoulli_",
    "random_"))


class _NoInitOnMeta(TorchFunctionMode):
    """Skips initialisers on meta tensors. Random ones (``normal_``, as every ``nn.Embedding``
    and GPT-2-style init calls) run torch's Python reference kernels there, and their first call
    imports ``torch._dynamo``: 1.2 s of the controller's start, before any worker was placed,
    to count parameters that are the same without them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INIT_METHODS or getattr(func, "__module__", None) == "torch.nn.init":
            t = args[0] if args else kwargs.get("tensor")   # torch.nn.init passes it by name
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def build_blocks_for_shapes(model: ModelSection, seed: int = 0) -> tuple[list[nn.Module], Callable, bool]:
    """The blocks, for their shapes (or for a restore to fill): ``(blocks, loss_fn, on_meta)``.

    Built on the meta device, so nothing is allocated, where the factory allows it. The
    factory's module is imported first, outside the meta device, as any user code would be
    (a module that makes and reads a tensor when imported fails under it); a build that reads
    real values (a weight file, a check of what it made) fails on meta and is built for real.
    """
    resolve_factory(model)  # imports the user's module, outside the meta device
    try:
        with torch.device("meta"), _NoInitOnMeta():
            blocks, loss_fn = build_blocks(model, seed)
        return blocks, loss_fn, True
    except ModelError as e:
        if not isinstance(e.__cause__, (RuntimeError, NotImplementedError)):
            raise
        log.info("model factory %s cannot build on the meta device (%s); building it for real to size it",
                 model.factory or "gpt", e.__cause__)
    blocks, loss_fn = build_blocks(model, seed)
    return blocks, loss_fn, False


def block_param_counts(model: ModelSection) -> list[int]:
    """Parameter count per block (built on the meta device where the factory allows it)."""
    blocks, _, _ = build_blocks_for_shapes(model)
    return [sum(p.numel() for p in b.parameters()) for b in blocks]

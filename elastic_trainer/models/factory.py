"""Build a model from the config: the built-in GPT or a user's import path."""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Callable

import torch
from torch import nn

from ..config import ModelSection
from ..errors import ModelError
from .gpt import TokenCrossEntropy, build_gpt
from .hf import blocks_of, build_hf_blocks, meta_model
from .meta import no_init_on_meta

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


ONLY_BLOCKS_ARG = "only_blocks"


def opts_in_to_rank_local(model: ModelSection) -> bool:
    """Whether ``model`` can build some of its blocks and not the rest: the built-in GPT and
    ``kind: hf`` always; a user factory that takes an ``only_blocks`` argument."""
    if model.kind in ("gpt", "hf"):
        return True
    try:
        params = inspect.signature(resolve_factory(model)).parameters
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        return False
    return ONLY_BLOCKS_ARG in params


def build_blocks(model: ModelSection, seed: int, only_blocks: list[int] | None = None
                 ) -> tuple[list[nn.Module], Callable]:
    """The factory's own build, under the run's seed: every block, or where the factory opts in
    (``opts_in_to_rank_local``) and ``only_blocks`` is given, those blocks (the list keeps the
    model's length; the entries left out may be None). The built-in models' seeded weights,
    the same under every layout, are ``build.build_model``'s."""
    fn = resolve_factory(model)
    if model.kind == "gpt":
        kwargs = dict(n_layer=model.n_layer, n_head=model.n_head, d_model=model.d_model,
                      seq_len=model.seq_len, vocab_size=model.vocab_size, dropout=model.dropout)
    elif model.kind == "hf":
        kwargs = dict(hf_config=model.hf_config, init_from=model.init_from)
    else:
        kwargs = dict(model.kwargs)
    partial = only_blocks is not None and model.kind == "factory" and opts_in_to_rank_local(model)
    if partial:
        kwargs[ONLY_BLOCKS_ARG] = sorted(only_blocks)
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
    wanted = set(only_blocks) if partial else range(len(blocks))
    bad = [i for i, b in enumerate(blocks) if not isinstance(b, nn.Module) and (i in wanted or b is not None)]
    if not blocks or bad:
        raise ModelError(
            f"model factory {model.factory} must return a non-empty list of nn.Module blocks; "
            f"got {len(blocks)} blocks, not modules at {bad}"
            + (f" (only the blocks asked for, {sorted(wanted)}, must be built; None is fine elsewhere)" if partial else "")
        )
    if not callable(loss_fn):
        raise ModelError(f"model factory {model.factory}: loss_fn {loss_fn!r} is not callable")
    return blocks, loss_fn


def build_blocks_for_shapes(model: ModelSection, seed: int = 0) -> tuple[list[nn.Module], Callable, bool]:
    """The blocks, for their shapes (or for a restore to fill): ``(blocks, loss_fn, on_meta)``.

    Built on the meta device, so nothing is allocated, where the factory allows it. The
    factory's module is imported first, outside the meta device, as any user code would be
    (a module that makes and reads a tensor when imported fails under it); a build that reads
    real values (a weight file, a check of what it made) fails on meta and is built for real.
    """
    if model.kind == "hf":  # the config is enough: no weights are read for shapes
        return blocks_of(meta_model(model.hf_config, model.init_from)), TokenCrossEntropy(), True
    resolve_factory(model)  # imports the user's module, outside the meta device
    try:
        # The factory is seeded (``build_blocks``): the caller's random state is put back after.
        with torch.device("meta"), no_init_on_meta(), torch.random.fork_rng(devices=[]):
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


def model_param_names(model) -> list[str]:
    """Every global parameter name of ``model`` (a ``ModelSection``), built on the meta device
    where the factory allows it."""
    blocks, _, _ = build_blocks_for_shapes(model)
    return [f"blocks.{i}.{n}" for i, b in enumerate(blocks) for n, _ in b.named_parameters()]

"""One model, built whole or a rank's share at a time, with the same initial weights under every layout.

For the built-in GPT and ``model.kind: hf``, every block is made on the meta
device (no memory), and only the blocks wanted are materialised: on the host,
one block at a time, where each module is initialised from a seed of its own,
derived from the run's seed, the block's index and the module's name in the
block (``module_seed``); then the block moves to the rank's device. So a
parameter's first value depends on nothing else: not on the other blocks a
process builds, nor the layout, nor the device. dp=2 x pp=2, 1 x 4 and one
process start from the same model, and no rank ever holds more than its own
blocks and one block on the host.

Modules are initialised children first, as transformers' ``initialize_weights``
goes, so a parent that re-draws a child's parameter (GPT-2's scaled residual
projections) does so last. A tied head (``hf.TIED_ATTR``) starts from its
leader's first value, computed where it is needed.

A seed-built Hugging Face model therefore differs from ``from_config`` under
the same ``torch.manual_seed``: that draws every parameter from one stream in
the model's order, so a block's values would depend on every block before it,
and a rank would have to draw them all to get its own.

With ``model.init_from`` the blocks are read from the folder instead, each
rank only its own tensors (``hf_load``; ``dcp_load`` for a torch distributed
checkpoint, which any kind may start from). A user factory builds the whole
model on every rank unless it takes ``only_blocks`` (``factory``).
"""

from __future__ import annotations

import copy
import hashlib
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from ..config import ModelSection, TrainerConfig
from .factory import build_blocks, build_blocks_for_shapes, opts_in_to_rank_local
from .gpt import TokenCrossEntropy, build_gpt, init_gpt_module
from .hf import block_ties, blocks_of, meta_model
from .dcp_load import DCPWeights, is_dcp
from .hf_load import HFWeights
from .meta import no_init_on_meta

log = logging.getLogger(__name__)


def module_seed(seed: int, block: int, name: str) -> int:
    """The seed of module ``name`` (its name in the block, "" for the block) of block ``block``."""
    digest = hashlib.blake2b(f"{seed}/{block}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


@dataclass
class _Recipe:
    """The model on the meta device, and how one of its modules is initialised."""

    blocks: list[nn.Module]
    loss_fn: Callable
    init_module: Callable[[str, nn.Module], None]   # (name in its block, module)

    @torch.no_grad()
    def init_block(self, block: nn.Module, index: int, seed: int) -> None:
        # Only the host's generator is drawn from (the block is on the host), and it is
        # put back after, so the build leaves the caller's random state as it was.
        with torch.random.fork_rng(devices=[]):
            for name, module in _post_order(block):
                torch.default_generator.manual_seed(module_seed(seed, index, name))
                self.init_module(name, module)


def _recipe(model: ModelSection) -> _Recipe:
    if model.kind == "gpt":
        with torch.device("meta"), no_init_on_meta():
            blocks, loss_fn = build_gpt(n_layer=model.n_layer, n_head=model.n_head, d_model=model.d_model,
                                        seq_len=model.seq_len, vocab_size=model.vocab_size, dropout=model.dropout)
        n_layer = model.n_layer
        return _Recipe(blocks, loss_fn, lambda name, m: init_gpt_module(name, m, n_layer))
    hf = meta_model(model.hf_config, model.init_from)

    def init_hf(name: str, m: nn.Module) -> None:
        # Torch's own initialisation first, as construction would have done, for what the
        # model's ``_init_weights`` leaves alone; then the model's.
        for p in m.parameters(recurse=False):   # a flag from the meta build would skip it
            if hasattr(p, "_is_hf_initialized"):
                del p._is_hf_initialized
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
        hf._init_weights(m)

    return _Recipe(blocks_of(hf), TokenCrossEntropy(), init_hf)


def _has_buffers(m) -> bool:
    return isinstance(m, nn.Module) and any(True for _ in m.buffers())


def build_own_blocks(model: ModelSection, seed: int, own: Iterable[int], device: torch.device | str = "cpu",
                     on_block: Callable[[int], None] | None = None
                     ) -> tuple[dict[int, nn.Module], Callable, list[tuple[str, str]], dict]:
    """Blocks ``own`` on ``device``, the loss, the model's ties (``hf.block_ties``) and how
    they were made: ``{"how": .., "files": [..]}``, how being ``"seed"`` (rank-local, seeded
    per module), ``"load"`` (rank-local, read from ``init_from``; files: those opened),
    ``"factory-part"`` (a factory that builds only what it is asked) or ``"whole"`` (every
    block built, the rest dropped)."""
    own = sorted(set(own))
    device = torch.device(device)
    if model.kind == "factory":
        partial = opts_in_to_rank_local(model)
        blocks, loss_fn = build_blocks(model, seed, only_blocks=own if partial else None)
        ties = block_ties(blocks) if not partial else block_ties(build_blocks_for_shapes(model)[0])
        how = _load_built(model, blocks, own, {"how": "factory-part" if partial else "whole"})
        return {i: blocks[i].to(device) for i in own}, loss_fn, ties, how
    recipe = _recipe(model)
    ties = block_ties(recipe.blocks)
    if any(_has_buffers(b) for b in recipe.blocks) or _has_buffers(recipe.loss_fn):
        # Buffers hold values no initialiser knows how to make (a causal mask, running
        # statistics): this model is built whole, in the same way on every rank.
        log.info("model has buffers: every rank builds it whole from the seed")
        blocks, loss_fn = build_blocks(model, seed)
        how = _load_built(model, blocks, own, {"how": "whole"})
        return {i: blocks[i].to(device) for i in own}, loss_fn, ties, how
    weights = init_weights(model)
    out: dict[int, nn.Module] = {}
    for i in own:
        block = recipe.blocks[i].to_empty(device="cpu")
        if weights is not None:
            weights.load_block(block, i, recipe.blocks)
        else:
            recipe.init_block(block, i, seed)
        out[i] = block.to(device)
        if on_block is not None:
            on_block(sum(p.numel() * p.element_size() for p in block.parameters()))
    if weights is None:
        _start_followers_from_leaders(recipe, out, ties, seed)
    if weights is None:
        return out, recipe.loss_fn, ties, {"how": "seed"}
    return out, recipe.loss_fn, ties, {"how": "load", "files": sorted(weights.opened)}


def init_weights(model: ModelSection) -> HFWeights | DCPWeights | None:
    """Where ``model.init_from``'s tensors are read from: a torch distributed checkpoint (any
    kind), else a Hugging Face folder (kind hf); None without ``init_from``."""
    if not model.init_from:
        return None
    if model.kind != "hf" or is_dcp(model.init_from):
        return DCPWeights(model.init_from)
    return HFWeights(model.init_from)


def _load_built(model: ModelSection, blocks: list, own: list[int], how: dict) -> dict:
    """Blocks ``own`` of a model built whole or by its factory, their weights then read from
    ``init_from`` where it is given; ``how`` with the files read."""
    weights = init_weights(model)
    if weights is None:
        return how
    for i in own:
        weights.load_block(blocks[i], i, blocks)
    return {**how, "files": sorted(weights.opened)}


@torch.no_grad()
def _start_followers_from_leaders(recipe: _Recipe, out: dict[int, nn.Module], ties, seed: int) -> None:
    for leader, follower in ties:
        _, fb, f_local = follower.split(".", 2)
        if int(fb) not in out:
            continue
        _, lb, l_local = leader.split(".", 2)
        lb = int(lb)
        if lb in out:
            value = out[lb].get_parameter(l_local)
        else:  # the leader's block, made here only to read its first value
            block = copy.deepcopy(recipe.blocks[lb]).to_empty(device="cpu")
            recipe.init_block(block, lb, seed)
            value = block.get_parameter(l_local)
        out[int(fb)].get_parameter(f_local).copy_(value)


def build_model(model: ModelSection | TrainerConfig, seed: int | None = None) -> tuple[list[nn.Module], Callable]:
    """``(blocks, loss_fn)``: the whole model in this process, on the host, with the initial
    weights every layout of a run with ``seed`` starts from (a config's own seed by default).
    What single-process references of a run are built from."""
    if isinstance(model, TrainerConfig):
        seed = model.train.seed if seed is None else seed
        model = model.model
    if seed is None:
        raise ValueError("build_model needs a seed with a ModelSection (a TrainerConfig brings its own)")
    n = len(build_blocks_for_shapes(model)[0])
    blocks, loss_fn, _, _ = build_own_blocks(model, seed, range(n))
    return [blocks[i] for i in range(n)], loss_fn


WHOLE_BUILD_WARN_BYTES = 2 << 30


def whole_build_warning(model: ModelSection) -> str | None:
    """What to tell the user of a factory that builds the whole model on every rank, where that
    model's fp32 parameters pass 2 GB; None otherwise."""
    if model.kind != "factory" or opts_in_to_rank_local(model):
        return None
    nbytes = 4 * sum(p.numel() for b in build_blocks_for_shapes(model)[0] for p in b.parameters())
    if nbytes <= WHOLE_BUILD_WARN_BYTES:
        return None
    return (f"model.factory {model.factory} builds the whole model ({nbytes / 2**30:.1f} GB of fp32 parameters) "
            "on every rank before each keeps its own blocks; give it an 'only_blocks' argument (the block "
            "indices to build, the others returned as None) so each rank builds only its own: see docs/models.md")

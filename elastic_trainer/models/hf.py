"""Hugging Face causal LMs as blocks: ``model.kind: hf``.

A ``transformers`` model is built from its config (or loaded from a local
``save_pretrained`` folder) and cut into ``[embeddings, decoder layer * n,
final norm + LM head]``, so any contiguous run of blocks can be a pipeline
stage, exactly like the built-in GPT. Two families are cut:

- Llama-like (``model.embed_tokens``, ``model.layers``, ``model.norm``,
  ``model.rotary_emb``, ``lm_head``): Llama and the models that share its
  layout. Rotary embeddings hold no parameters; each decoder-layer block
  recomputes them from the positions, so only hidden states cross a stage.
- GPT-2 (``transformer.wte``, ``wpe``, ``h``, ``ln_f``, ``lm_head``): learned
  position embeddings live in the embeddings block.

Attention runs through SDPA with no mask, which is causal (the eager kernel
without a mask would not be), and the whole-model forward's logits are
reproduced to float rounding.

Tied embeddings (GPT-2's default; ``tie_word_embeddings``) would pin the first
and last blocks to one stage. They are cut into two parameters with the same
initial value; the head block declares the tie (``TIED_ATTR``) and the
trainer sums the two gradients every step, so both copies take the same
update and stay equal: training matches the tied model's, and the export
writes one tensor.

Every block records the Hugging Face name of each of its parameters
(``HF_NAMES_ATTR``), which is how ``hf_export`` writes a folder that
``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from ..errors import ModelError
from .gpt import TokenCrossEntropy
from .meta import no_init_on_meta

TIED_ATTR = "_et_tied"        # {local param name: (block index, local param name)} it equals
HF_NAMES_ATTR = "_et_hf_names"  # {local param name: Hugging Face parameter name}


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - a dependency of the project
        raise ModelError(f"model.kind 'hf' needs the transformers package: {e}") from None
    return transformers


def load_hf_config(hf_config: dict[str, Any] | str | None, init_from: str | None):
    """The ``transformers`` config: from a dict (with ``model_type``), a config.json or a folder
    holding one, else ``init_from``'s. Only local files are read."""
    tf = _transformers()
    if hf_config is None:
        hf_config = init_from
    if isinstance(hf_config, dict):
        raw = dict(hf_config)
        model_type = raw.pop("model_type")
        try:
            return tf.AutoConfig.for_model(model_type, **raw)
        except (ValueError, KeyError) as e:
            raise ModelError(f"model.hf_config: model_type {model_type!r} is not a transformers model: {e}") from None
    path = os.path.expanduser(hf_config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ModelError(f"model.hf_config / init_from({hf_config!r}): no config.json there (local files only)")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"model.hf_config({hf_config!r}) is not a readable config.json: {e}") from None
    if "model_type" not in raw:
        raise ModelError(f"{path} has no model_type; keys there: {sorted(raw)[:12]}")
    return load_hf_config(raw, None)


def hf_config_dict(hf_config, init_from) -> dict:
    """The resolved config as a plain dict (recorded with the weights, for the export)."""
    return load_hf_config(hf_config, init_from).to_dict()


class _Embed(nn.Module):
    def __init__(self, embed_tokens: nn.Module, wpe: nn.Module | None = None, drop: nn.Module | None = None):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.wpe = wpe
        self.drop = drop if drop is not None else nn.Identity()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        if self.wpe is not None:
            h = h + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        return self.drop(h)


class _LlamaLayer(nn.Module):
    def __init__(self, layer: nn.Module, rotary: nn.Module):
        super().__init__()
        self.layer = layer
        # Not a submodule: the rotary tables are a function of the config, made on first use on
        # the device of the hidden states. So the block has no buffers, and a restore can build
        # it on the meta device and fill only its parameters.
        self._rotary_make = (type(rotary), rotary.config)
        self._rotary: dict = {}

    def rotary(self, h: torch.Tensor, pos: torch.Tensor):
        rot = self._rotary.get(h.device)
        if rot is None:
            cls, config = self._rotary_make
            with torch.device("cpu"):
                rot = self._rotary[h.device] = cls(config).to(h.device)
        return rot(h, pos)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        out = self.layer(h, attention_mask=None, position_ids=pos, position_embeddings=self.rotary(h, pos))
        return out[0] if isinstance(out, tuple) else out


class _Layer(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.layer(h, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))


def _cut(model) -> list[nn.Module]:
    inner = getattr(model, "model", None)
    if inner is not None and all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return ([_Embed(inner.embed_tokens)] + [_LlamaLayer(layer, inner.rotary_emb) for layer in inner.layers]
                + [_Head(inner.norm, model.lm_head)])
    tr = getattr(model, "transformer", None)
    if tr is not None and all(hasattr(tr, a) for a in ("wte", "wpe", "h", "ln_f")):
        return [_Embed(tr.wte, tr.wpe, tr.drop)] + [_Layer(b) for b in tr.h] + [_Head(tr.ln_f, model.lm_head)]
    raise ModelError(f"{type(model).__name__}: cut into blocks for Llama-like models (model.embed_tokens, "
                     "model.layers, model.norm, model.rotary_emb) and GPT-2 (transformer.wte/wpe/h/ln_f) only")


def _check_supported(config) -> None:
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        raise ModelError(f"{config.model_type}: sliding-window attention (sliding_window={window}) is not "
                         "supported; the blocks run full causal attention")
    if getattr(config, "add_cross_attention", False):
        raise ModelError(f"{config.model_type}: cross-attention is not supported in a causal LM's blocks")


def build_hf_blocks(hf_config: dict | str | None = None, init_from: str | None = None
                    ) -> tuple[list[nn.Module], nn.Module]:
    """``(blocks, loss_fn)`` of a Hugging Face causal LM: built from ``hf_config`` with the
    current torch seed, or loaded from the ``save_pretrained`` folder ``init_from``, in fp32."""
    tf = _transformers()
    config = load_hf_config(hf_config, init_from)
    _check_supported(config)
    config.use_cache = False
    try:
        if init_from is not None:
            if not os.path.isdir(os.path.expanduser(init_from)):
                raise ModelError(f"model.init_from({init_from!r}) is not a local folder")
            model = tf.AutoModelForCausalLM.from_pretrained(
                os.path.expanduser(init_from), config=config, local_files_only=True,
                dtype=torch.float32, attn_implementation="sdpa")
        else:
            model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    except ModelError:
        raise
    except (OSError, ValueError) as e:
        raise ModelError(f"transformers could not build {config.model_type} "
                         f"({'from ' + init_from if init_from else 'from its config'}): {e}") from None
    blocks = blocks_of(model)
    model.train()
    return blocks, TokenCrossEntropy()


def blocks_of(model) -> list[nn.Module]:
    """``model`` cut into blocks, each naming its parameters' Hugging Face names, a tied head
    given its own copy of the embedding (declared with ``TIED_ATTR``)."""
    hf_names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        hf_names.setdefault(id(p), name)
    embed_weight = model.get_input_embeddings().weight
    tied = model.lm_head.weight is embed_weight
    blocks = _cut(model)
    if tied:
        # One tensor cannot sit on two pipeline stages: the head gets its own copy, kept equal.
        blocks[-1].lm_head.weight = nn.Parameter(embed_weight.detach().clone())
        setattr(blocks[-1], TIED_ATTR, {"lm_head.weight": (0, "embed_tokens.weight")})
    for block in blocks:
        setattr(block, HF_NAMES_ATTR, {local: hf_names[id(p)] for local, p in block.named_parameters()
                                       if id(p) in hf_names})
    if tied:
        getattr(blocks[-1], HF_NAMES_ATTR)["lm_head.weight"] = "lm_head.weight"  # the copy made above
    return blocks


def meta_model(hf_config: dict | str | None, init_from: str | None):
    """The Hugging Face model of the config, on the meta device: its structure and its own
    ``_init_weights``, with no memory and no initialisation run."""
    tf = _transformers()
    config = load_hf_config(hf_config, init_from)
    _check_supported(config)
    config.use_cache = False
    with torch.device("meta"), no_init_on_meta():
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    return model


def block_ties(blocks: list[nn.Module]) -> list[tuple[str, str]]:
    """``(leader, follower)`` global parameter names that must stay equal (tied embeddings)."""
    out = []
    for i, b in enumerate(blocks):
        for local, (j, other) in getattr(b, TIED_ATTR, {}).items():
            out.append((f"blocks.{j}.{other}", f"blocks.{i}.{local}"))
    return sorted(out)


def hf_name_map(blocks: list[nn.Module]) -> dict[str, str]:
    """Global parameter name (``blocks.<i>.<local>``) -> Hugging Face name, followers of a tie left out."""
    followers = {f for _, f in block_ties(blocks)}
    out = {}
    for i, b in enumerate(blocks):
        for local, hf in getattr(b, HF_NAMES_ATTR, {}).items():
            g = f"blocks.{i}.{local}"
            if g not in followers:
                out[g] = hf
    return out

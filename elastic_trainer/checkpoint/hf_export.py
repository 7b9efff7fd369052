"""Trained weights out as a Hugging Face folder: ``elastic-trainer export SOURCE --hf OUT``.

The folder holds ``config.json`` and ``model.safetensors`` under the model's own
parameter names, so ``AutoModelForCausalLM.from_pretrained(OUT)`` loads it with
no code from this project. A tied pair (embeddings and LM head) is written
once, as ``transformers`` expects, and tied again on load.

SOURCE is what a run leaves: its weights file (``model.safetensors``, or the
run's output folder holding it, or ``model-step-N.safetensors`` from a failed
run) or a durable checkpoint directory (``step-N-<run id>``). Either records
the model's config, so the export needs nothing else. Runs of ``kind: hf``
write the folder at their end too (``<output_dir>/hf``).
"""

from __future__ import annotations

import pyarrow.fs as pafs
import torch
from safetensors.torch import save as st_save

from ..config import ModelSection
from ..data.dataset import resolve_filesystem
from ..errors import ConfigError, ElasticTrainerError
from ..models.hf import build_hf_blocks, hf_config_dict, hf_name_map, load_hf_config
from .durable import MANIFEST, DurableStore
from .weights import WEIGHTS, load_weights, read_metadata, weights_from_shards


class ExportError(ElasticTrainerError):
    """The source cannot be exported as asked."""


def load_trained(source: str) -> tuple[dict[str, torch.Tensor], ModelSection, dict | None, int | None]:
    """``(state by global name, model section, resolved HF config or None, step)`` of a weights
    file, a run's output folder, or a durable checkpoint directory."""
    fs, path = resolve_filesystem(source)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise ExportError(f"{source!r} does not exist: give a run's model.safetensors, its output folder, "
                          "or a durable checkpoint directory (step-N-<run id>)")
    if info.type == pafs.FileType.Directory:
        if fs.get_file_info(f"{path}/{MANIFEST}").type == pafs.FileType.File:
            parent, _, name = source.rstrip("/").rpartition("/")
            store = DurableStore(parent or ".")
            shards, manifest = store.load_dir(name)
            model = ModelSection.model_validate(manifest["config"]["model"])
            return weights_from_shards(shards), model, manifest.get("hf_config"), manifest["step"]
        if fs.get_file_info(f"{path}/{WEIGHTS}").type != pafs.FileType.File:
            raise ExportError(f"{source!r} holds neither {WEIGHTS} (a run's output folder) nor {MANIFEST} "
                              "(a durable checkpoint)")
        source = f"{source.rstrip('/')}/{WEIGHTS}"
    meta = read_metadata(source)
    if "model" not in meta:
        raise ExportError(f"{source!r} has no model in its header: not a weights file this project wrote")
    return load_weights(source), ModelSection.model_validate(meta["model"]), meta.get("hf_config"), meta.get("step")


def hf_state(state: dict[str, torch.Tensor], model: ModelSection, hf_config: dict | None = None
             ) -> tuple[dict[str, torch.Tensor], object]:
    """The weights under Hugging Face names, and the ``transformers`` config."""
    if model.kind != "hf":
        raise ExportError(f"--hf needs a run of model.kind 'hf'; this one is {model.kind!r} (its weights "
                          "file, by global block names, is already loadable with safetensors)")
    config_src = hf_config or model.hf_config
    try:
        config = load_hf_config(config_src, model.init_from)
    except ElasticTrainerError as e:
        raise ExportError(f"the model's config cannot be read: {e}") from None
    with torch.device("meta"):
        blocks, _ = build_hf_blocks(hf_config=config.to_dict())
    names = hf_name_map(blocks)
    missing = sorted(set(names) - set(state))
    if missing:
        raise ExportError(f"the weights lack {len(missing)} of the model's parameters, e.g. {missing[:3]}")
    return {hf: state[g].detach().to(torch.float32).contiguous() for g, hf in names.items()}, config


def write_hf_folder(state: dict[str, torch.Tensor], model: ModelSection, out_dir: str,
                    hf_config: dict | None = None) -> str:
    """Write ``config.json`` and ``model.safetensors`` to ``out_dir`` (local or a filesystem URI)."""
    tensors, config = hf_state(state, model, hf_config)
    fs, root = resolve_filesystem(out_dir)
    fs.create_dir(root, recursive=True)
    with fs.open_output_stream(f"{root}/config.json") as f:
        f.write(config.to_json_string().encode())
    with fs.open_output_stream(f"{root}/model.safetensors") as f:
        f.write(st_save(tensors, metadata={"format": "pt"}))
    return root if "://" not in out_dir else out_dir.rstrip("/")


def export(source: str, out_dir: str) -> str:
    """Export ``source`` (see the module docstring) as a Hugging Face folder at ``out_dir``."""
    state, model, hf_config, _ = load_trained(source)
    return write_hf_folder(state, model, out_dir, hf_config)


def recorded_config(model: ModelSection) -> dict | None:
    """What the weights' header records of an HF model's config (resolved, so a moved config.json
    does not stop an export)."""
    if model.kind != "hf":
        return None
    try:
        return hf_config_dict(model.hf_config, model.init_from)
    except ElasticTrainerError as e:
        raise ConfigError(f"model.hf_config: {e}") from None

"""Trained weights out as a Hugging Face folder: ``elastic-trainer export SOURCE --hf OUT``.

The folder holds ``config.json``, ``generation_config.json`` and the weights in
Hugging Face's sharded layout (``model-0000k-of-0000n.safetensors`` and
``model.safetensors.index.json``) under the model's own parameter names, so
``AutoModelForCausalLM.from_pretrained(OUT)`` loads it with no code from this
project. A tied pair (embeddings and LM head) is written once, as
``transformers`` expects, and tied again on load. The export streams: it holds
one part of the source at a time.

SOURCE is what a run leaves: its output folder (the sharded weights, or a
``model.safetensors`` of an earlier version), a weights file, the
``model-step-N`` folder of a failed run, or a durable checkpoint directory
(``step-N-<run id>``). Each records the model's config, so the export needs
nothing else. Runs of ``kind: hf`` write the folder at their end too
(``<output_dir>/hf``), each rank its own stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Iterator

import pyarrow.fs as pafs
import torch
from safetensors.torch import save as st_save

from ..config import ModelSection
from ..storage.filesystems import open_fs
from ..storage.uris import is_uri, split_last, split_secrets
from ..errors import ConfigError, ElasticTrainerError
from ..models.hf import build_hf_blocks, hf_config_dict, hf_name_map, load_hf_config
from .durable import MANIFEST, DurableStore
from .weights import (WeightsError, iter_weights, part_file, read_metadata, weight_files, weights_from_shards,
                      write_index, write_safetensors)


class ExportError(ElasticTrainerError):
    """The source cannot be exported as asked."""


@dataclass
class ExportSource:
    """What an export reads: a durable checkpoint (``store``, its ``name``, its ``manifest``) or
    a run's weights (``meta``, their metadata, in ``n_files`` files)."""

    store: DurableStore | None = None
    name: str | None = None
    manifest: dict | None = None
    meta: dict | None = None
    n_files: int = 0


def export_source(source: str) -> ExportSource:
    """``source`` found: a durable checkpoint directory (holding its manifest), else a run's
    weights (its output folder, sharded or one file, or a weights file); an ``ExportError`` naming
    what would fit where it is neither."""
    fs, path = open_fs(source, "weights")
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise ExportError(f"{source!r} does not exist: give a run's output folder, its weights file, "
                          "or a durable checkpoint directory (step-N-<run id>)")
    if info.type == pafs.FileType.Directory and fs.get_file_info(f"{path}/{MANIFEST}").type == pafs.FileType.File:
        parent, name = split_last(source)
        store = DurableStore(parent or ".")
        return ExportSource(store=store, name=name, manifest=store.read_manifest(name))
    try:
        _, files, _ = weight_files(source)
        meta = read_metadata(source)
    except WeightsError as e:
        raise ExportError(f"{source!r}: {e} (give a run's output folder, its weights file, or a durable "
                          f"checkpoint directory holding {MANIFEST})") from None
    if "model" not in meta:
        raise ExportError(f"{source!r} records no model: not weights this project wrote")
    return ExportSource(meta=meta, n_files=len(files))


def trained_parts(source: str) -> tuple[ModelSection, dict | None, int, Iterator[dict[str, torch.Tensor]]]:
    """``(model section, resolved HF config or None, number of parts, the parts)`` of a run's
    weights (its output folder, sharded or one file, or a weights file) or a durable checkpoint
    directory: each part's tensors by global name, read one part at a time."""
    src = export_source(source)
    if src.manifest is not None:
        store, name, manifest = src.store, src.name, src.manifest
        model = ModelSection.model_validate(manifest["config"]["model"])
        files, groups = manifest["files"], DurableStore.file_groups(manifest["files"])
        parts = (weights_from_shards([store.read_part(name, files[i], manifest["step"]) for i in g]) for g in groups)
        return model, manifest.get("hf_config"), len(groups), parts
    meta = src.meta
    return ModelSection.model_validate(meta["model"]), meta.get("hf_config"), src.n_files, iter_weights(source)


def hf_state(state: dict[str, torch.Tensor], model: ModelSection, hf_config: dict | None = None
             ) -> tuple[dict[str, torch.Tensor], object]:
    """The weights under Hugging Face names, and the ``transformers`` config."""
    names, config = hf_names(model, hf_config)
    missing = sorted(set(names) - set(state))
    if missing:
        raise ExportError(f"the weights lack {len(missing)} of the model's parameters, e.g. {missing[:3]}")
    return {hf: state[g].detach().to(torch.float32).contiguous() for g, hf in names.items()}, config


def hf_names(model: ModelSection, hf_config: dict | None = None) -> tuple[dict[str, str], object]:
    """(global parameter name -> Hugging Face name, followers of a tie left out; the
    ``transformers`` config) of an HF model, from its config on the meta device."""
    if model.kind != "hf":
        raise ExportError(f"--hf needs a run of model.kind 'hf'; this one is {model.kind!r} (its weights, "
                          "by global block names, load with elastic_trainer.checkpoint.weights.load_weights)")
    try:
        config = load_hf_config(hf_config or model.hf_config, model.init_from)
    except ElasticTrainerError as e:
        raise ExportError(f"the model's config cannot be read: {e}") from None
    with torch.device("meta"):
        blocks, _ = build_hf_blocks(hf_config=config.to_dict())
    return hf_name_map(blocks), config


def write_hf_configs(config, out_dir: str) -> None:
    """``config.json``, and ``generation_config.json`` where the model generates, into ``out_dir``."""
    import transformers

    fs, root = open_fs(out_dir, "out")
    fs.create_dir(root, recursive=True)
    with fs.open_output_stream(f"{root}/config.json") as f:
        f.write(config.to_json_string().encode())
    try:
        gen = transformers.GenerationConfig.from_model_config(config)
    except Exception:  # noqa: BLE001 - a model with no generation defaults writes none
        return
    with fs.open_output_stream(f"{root}/generation_config.json") as f:
        f.write(gen.to_json_string().encode())


def write_hf_folder(state: dict[str, torch.Tensor], model: ModelSection, out_dir: str,
                    hf_config: dict | None = None) -> str:
    """Write ``config.json`` and ``model.safetensors`` to ``out_dir`` (local or a filesystem URI)."""
    tensors, config = hf_state(state, model, hf_config)
    fs, root = open_fs(out_dir, "out")
    write_hf_configs(config, out_dir)
    with fs.open_output_stream(f"{root}/model.safetensors") as f:
        f.write(st_save(tensors, metadata={"format": "pt"}))
    return root if not is_uri(out_dir) else split_secrets(out_dir)[0]


def export(source: str, out_dir: str) -> str:
    """Export ``source`` (see ``trained_parts``) as a Hugging Face folder at ``out_dir``, one part
    at a time: each part of the source becomes a part of the folder, under Hugging Face names."""
    model, hf_config, n, parts = trained_parts(source)
    names, config = hf_names(model, hf_config)
    written, entries = set(), []
    for k, state in enumerate(parts):
        tensors = {names[g]: t.to(torch.float32).contiguous() for g, t in state.items()
                   if g in names and g not in written}
        written |= {g for g in state if g in names}
        del state
        entries.append(write_safetensors(out_dir, part_file(k, n), tensors, {"format": "pt"}, retries=3,
                                         as_json=False))
    missing = sorted(set(names) - written)
    if missing:
        raise ExportError(f"the weights lack {len(missing)} of the model's parameters, e.g. {missing[:3]}")
    write_hf_configs(config, out_dir)
    return write_index(out_dir, entries, {})


def recorded_config(model: ModelSection) -> dict | None:
    """What the weights' header records of an HF model's config (resolved, so a moved config.json
    does not stop an export)."""
    if model.kind != "hf":
        return None
    try:
        return hf_config_dict(model.hf_config, model.init_from)
    except ElasticTrainerError as e:
        raise ConfigError(f"model.hf_config: {e}") from None

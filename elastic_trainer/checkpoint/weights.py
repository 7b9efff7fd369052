"""The trained model as files: by global parameter name, written and verified.

At the end of a run the ranks of one live replica each write their own
stage's tensors, in the Hugging Face sharded layout: ``model-0000k-of-0000n.safetensors``
per pipeline rank, and ``model.safetensors.index.json`` (which file holds each
tensor, and the run's metadata), which the controller writes last, once every
part is written and read back against its checksum. No process holds the
whole model. A single ``model.safetensors`` (the emergency copy of a failed
run without durable storage, and runs of earlier versions) is read the same
way. To a local path or any pyarrow filesystem URI; safetensors holds tensors
only, so loading never runs code, and any tool that reads the format (Hugging
Face's included) reads it.
"""

from __future__ import annotations

import hashlib
import json
import time

import pyarrow.fs as pafs
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..storage.filesystems import open_fs
from ..storage.uris import join, split_secrets
from ..errors import ElasticTrainerError
from .dtypes import as_tensor
from .slices import assemble_param
from ..storage.retry import with_retries

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def part_file(k: int, n: int) -> str:
    """The name of part ``k`` (0-based) of ``n``, as Hugging Face names its shards."""
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


class WeightsError(ElasticTrainerError):
    """The weights could not be written, or what was read back is not what was written."""


def weights_from_shards(shards: list[dict], dtypes: dict[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """Parameters of snapshot shards (numpy, bf16 as its bits) as tensors by global name.
    ``dtypes``: the live dtype of each name where it is not the stored one (bf16)."""
    out = {}
    sliced: dict[str, list] = {}
    for s in shards:
        ranges = s.get("ranges") or {}
        for name, a in s["params"].items():
            if name in ranges:   # a sharded optimizer's slice: put together below
                sliced.setdefault(name, []).append((ranges[name], a))
            else:
                out.setdefault(name, as_tensor(a, (dtypes or {}).get(name, torch.float32)).clone())
    for name, pieces in sliced.items():
        if name not in out:
            whole = assemble_param(name, pieces)
            out[name] = as_tensor(whole, (dtypes or {}).get(name, torch.float32)).clone()
    return out


def write_safetensors(where: str, name: str, state: dict[str, torch.Tensor], metadata: dict, retries: int = 3,
                      as_json: bool = True) -> dict:
    """Write ``state`` to ``<where>/<name>``, read it back and check its checksum; ``{"file", "path",
    "sha256", "bytes", "names", "seconds"}``. ``metadata`` (JSON-able) goes into the file's header
    as JSON strings (``as_json``; else as the strings given: Hugging Face's ``{"format": "pt"}``).
    Raises :class:`WeightsError` where it cannot be written or does not read back."""
    t0 = time.perf_counter()
    fs, root = open_fs(where, "run.output_dir")
    path = f"{root.rstrip('/')}/{name}"
    tensors = {k: v.detach().cpu().contiguous() for k, v in sorted(state.items())}
    data = st_save(tensors, metadata={k: json.dumps(v) if as_json else v for k, v in metadata.items()})
    del tensors
    digest = hashlib.sha256(data).hexdigest()

    def write():
        fs.create_dir(root, recursive=True)
        with fs.open_output_stream(path) as f:
            f.write(data)

    def read():
        with fs.open_input_stream(path) as f:
            return f.read()

    try:
        with_retries(write, f"writing {path}", retries)
        back = with_retries(read, f"reading back {path}", retries)
    except (OSError, ElasticTrainerError) as e:
        raise WeightsError(f"{name} was not saved to {where}: {type(e).__name__}: {e}") from None
    if hashlib.sha256(back).hexdigest() != digest:
        raise WeightsError(f"{path} reads back {len(back)} bytes that differ from the {len(data)} written")
    shown = path if isinstance(fs, pafs.LocalFileSystem) else join(split_secrets(where)[0], name)
    return {"file": name, "path": shown, "sha256": digest, "bytes": len(data), "names": sorted(state),
            "seconds": time.perf_counter() - t0}


def save_weights(where: str, state: dict[str, torch.Tensor], metadata: dict, retries: int = 3,
                 name: str = WEIGHTS) -> str:
    """Write ``state`` as the one file ``<where>/<name>``, verified (``write_safetensors``); the path."""
    return write_safetensors(where, name, state, metadata, retries)["path"]


def not_seen(fs, paths: list[str], sizes: list[int]) -> list[int]:
    """The indices of ``paths`` (files written by other processes, perhaps on other machines)
    that ``fs`` does not show here with their ``sizes``: a local path that is not one shared
    filesystem holds each on its own writer's machine."""
    infos = fs.get_file_info(paths)
    return [i for i, (info, n) in enumerate(zip(infos, sizes)) if info.type != pafs.FileType.File or info.size != n]


def unseen_parts(where: str, parts: list[dict]) -> list[dict]:
    """Those of ``parts`` (``write_safetensors`` entries) that ``where`` does not show here
    (``not_seen``)."""
    fs, root = open_fs(where, "run.output_dir")
    gone = not_seen(fs, [f"{root.rstrip('/')}/{p['file']}" for p in parts], [p["bytes"] for p in parts])
    return [parts[i] for i in gone]


def write_index(where: str, parts: list[dict], metadata: dict, retries: int = 3) -> str:
    """Write ``<where>/model.safetensors.index.json`` for ``parts`` (``write_safetensors`` entries,
    every one written and verified): each tensor's file, the total size, and ``metadata``. The
    folder's path (what ``load_weights`` and ``from_pretrained`` take)."""
    fs, root = open_fs(where, "run.output_dir")
    weight_map = {n: p["file"] for p in parts for n in p["names"]}
    doc = {"metadata": {"total_size": sum(p["bytes"] for p in parts), **metadata,
                        "files": {p["file"]: {"sha256": p["sha256"], "bytes": p["bytes"]} for p in parts}},
           "weight_map": dict(sorted(weight_map.items()))}

    def write():
        fs.create_dir(root, recursive=True)
        with fs.open_output_stream(f"{root.rstrip('/')}/{INDEX}") as f:
            f.write(json.dumps(doc, indent=1).encode())

    try:
        with_retries(write, f"writing {root}/{INDEX}", retries)
    except (OSError, ElasticTrainerError) as e:
        raise WeightsError(f"the index of the weights was not saved to {where}: {type(e).__name__}: {e}") from None
    return root.rstrip("/") if isinstance(fs, pafs.LocalFileSystem) else split_secrets(where)[0]


def weight_files(path: str) -> tuple[object, list[str], dict]:
    """``(filesystem, paths of the safetensors files, index metadata)`` of ``path``: a folder with
    ``model.safetensors.index.json`` (sharded), a folder with ``model.safetensors``, or a file."""
    fs, p = open_fs(path, "weights")
    info = fs.get_file_info(p)
    if info.type == pafs.FileType.Directory:
        index = f"{p.rstrip('/')}/{INDEX}"
        if fs.get_file_info(index).type == pafs.FileType.File:
            with fs.open_input_stream(index) as f:
                doc = json.loads(f.read())
            files = sorted(set(doc["weight_map"].values()))
            return fs, [f"{p.rstrip('/')}/{name}" for name in files], doc.get("metadata") or {}
        p = f"{p.rstrip('/')}/{WEIGHTS}"
        if fs.get_file_info(p).type != pafs.FileType.File:
            raise WeightsError(f"{path} holds neither {INDEX} nor {WEIGHTS}")
    elif info.type == pafs.FileType.NotFound:
        raise WeightsError(f"{path} does not exist")
    return fs, [p], {}


def iter_weights(path: str):
    """``(file's tensors by name)`` of each file of the weights at ``path`` in turn: one file
    held at a time (see ``weight_files``)."""
    fs, files, _ = weight_files(path)
    for f_path in files:
        with fs.open_input_stream(f_path) as f:
            yield st_load(f.read())


def load_weights(path: str) -> dict[str, torch.Tensor]:
    """The tensors of the weights at ``path`` (a run's output folder, sharded or one file, or a
    file; local or a filesystem URI) by global parameter name: the whole model, in this process."""
    out: dict[str, torch.Tensor] = {}
    for part in iter_weights(path):
        out.update(part)
    return out


def read_metadata(path: str) -> dict:
    """The run's metadata of the weights at ``path``: a sharded folder's index, else the JSON
    header values of the file (``{}`` if none), read from the header alone, not its tensors."""
    fs, files, meta = weight_files(path)
    if meta:
        return {k: v for k, v in meta.items() if k not in ("total_size", "files")}
    p = files[0]
    try:
        with fs.open_input_file(p) as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n < 100 << 20:
                raise WeightsError(f"{path} is not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path}: unreadable safetensors header: {e}") from None
    out = {}
    for k, v in (header.get("__metadata__") or {}).items():
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out

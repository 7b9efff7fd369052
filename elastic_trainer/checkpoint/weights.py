"""The trained model as a file: ``model.safetensors`` by global parameter name, written and verified.

Written at the end of every run (and from the newest snapshot on the way out of
a failed run without durable storage), to a local path or any pyarrow
filesystem URI. safetensors holds tensors only, so loading it never runs code,
and any tool that reads the format (Hugging Face's included) reads it.
"""

from __future__ import annotations

import hashlib
import json

import pyarrow.fs as pafs
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..data.dataset import resolve_filesystem
from ..errors import ElasticTrainerError
from .dtypes import as_tensor
from ..retry import with_retries

WEIGHTS = "model.safetensors"


class WeightsError(ElasticTrainerError):
    """The weights could not be written, or what was read back is not what was written."""


def weights_from_shards(shards: list[dict], dtypes: dict[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """Parameters of snapshot shards (numpy, bf16 as its bits) as tensors by global name.
    ``dtypes``: the live dtype of each name where it is not the stored one (bf16)."""
    out = {}
    for s in shards:
        for name, a in s["params"].items():
            out.setdefault(name, as_tensor(a, (dtypes or {}).get(name, torch.float32)).clone())
    return out


def save_weights(where: str, state: dict[str, torch.Tensor], metadata: dict, retries: int = 3,
                 name: str = WEIGHTS) -> str:
    """Write ``state`` to ``<where>/<name>``, read it back and check every tensor; the path.

    ``metadata`` (JSON-able) goes into the file's header as strings. Raises
    :class:`WeightsError` where the file cannot be written or does not read back the same."""
    fs, root = resolve_filesystem(where)
    path = f"{root.rstrip('/')}/{name}"
    tensors = {k: v.detach().cpu().contiguous() for k, v in sorted(state.items())}
    data = st_save(tensors, metadata={k: json.dumps(v) for k, v in metadata.items()})

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
        raise WeightsError(f"the weights were not saved to {where}: {type(e).__name__}: {e}") from None
    if hashlib.sha256(back).digest() != hashlib.sha256(data).digest():
        raise WeightsError(f"{path} reads back {len(back)} bytes that differ from the {len(data)} written")
    loaded = st_load(back)
    bad = [k for k, v in tensors.items() if k not in loaded or not torch.equal(loaded[k], v)]
    if bad or set(loaded) != set(tensors):
        raise WeightsError(f"{path} does not read back as written: {len(bad)} tensors differ (e.g. {bad[:3]})")
    return path if isinstance(fs, pafs.LocalFileSystem) else f"{where.rstrip('/')}/{name}"


def load_weights(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a weights file (local path or filesystem URI) by global parameter name."""
    fs, p = resolve_filesystem(path)
    with fs.open_input_stream(p) as f:
        return st_load(f.read())


def read_metadata(path: str) -> dict:
    """The JSON header values of a weights file written by :func:`save_weights` (``{}`` if none):
    read from the file's header alone, not its tensors."""
    fs, p = resolve_filesystem(path)
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

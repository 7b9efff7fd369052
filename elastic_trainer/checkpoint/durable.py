"""Durable checkpoints on any pyarrow filesystem (local path, s3://, gs://, hdfs://).

Layout under ``storage``::

    step-00000040/shard-000.pt ...   tensors only (torch.save of dicts of tensors)
    step-00000040/manifest.json      written last: step, files with sha256, blocks, history

A directory without a manifest is half-written and ignored; a file whose
checksum does not match marks the checkpoint corrupt, and the loader reports it
and falls back to the previous one. Loading uses ``torch.load(weights_only=True)``
so a checkpoint can never run code.
"""

from __future__ import annotations

import hashlib
import io
import json
import time

import numpy as np
import pyarrow.fs as pafs
import torch

from ..data.dataset import resolve_filesystem
from ..errors import ElasticTrainerError

FORMAT = 1
MANIFEST = "manifest.json"


class CheckpointError(ElasticTrainerError):
    """A durable checkpoint is missing, half-written or corrupt."""


def _dirname(step: int) -> str:
    return f"step-{step:08d}"


def _tensors(obj):
    """numpy arrays -> tensors, through nested dicts (what weights_only loading accepts)."""
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, np.ndarray | np.generic):
        return torch.from_numpy(np.array(obj))
    return obj


def _arrays(obj):
    if isinstance(obj, dict):
        return {k: _arrays(v) for k, v in obj.items()}
    if torch.is_tensor(obj):
        return obj.numpy()
    return obj


def _to_torch(shard: dict) -> dict:
    return {
        "params": {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in shard["params"].items()},
        "optim": _tensors(shard["optim"]),
        "comm": _tensors(shard.get("comm") or {}),
        "comm_meta": _tensors(shard.get("comm_meta") or {}),
        "extra": _tensors(shard.get("extra") or {}),
    }


def _to_numpy(obj: dict, step: int, blocks: list[int]) -> dict:
    return {
        "step": step, "blocks": blocks, "extra": _arrays(obj.get("extra", {})),
        "params": {n: t.numpy() for n, t in obj["params"].items()},
        "optim": _arrays(obj["optim"]),
        "comm": _arrays(obj.get("comm", {})),
        "comm_meta": _arrays(obj.get("comm_meta", {})),
    }


class DurableStore:
    def __init__(self, uri: str):
        self.uri = uri
        self.fs, self.root = resolve_filesystem(uri)

    def _path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def save(self, step: int, shards: list[dict], meta: dict) -> str:
        """Write shards of one step (together covering every block); the manifest goes last."""
        if len({s["step"] for s in shards}) != 1 or shards[0]["step"] != step:
            raise ValueError(f"shards of steps {sorted({s['step'] for s in shards})} given for step {step}")
        d = self._path(_dirname(step))
        self.fs.create_dir(d, recursive=True)
        files = []
        for i, shard in enumerate(shards):
            buf = io.BytesIO()
            torch.save(_to_torch(shard), buf)
            data = buf.getvalue()
            name = f"shard-{i:03d}.pt"
            with self.fs.open_output_stream(f"{d}/{name}") as f:
                f.write(data)
            files.append({"name": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                          "blocks": list(shard["blocks"])})
        manifest = {"format": FORMAT, "step": step, "created": time.time(), "files": files, **meta}
        with self.fs.open_output_stream(f"{d}/{MANIFEST}") as f:
            f.write(json.dumps(manifest).encode())
        return d

    def steps(self) -> list[int]:
        """Steps that have a checkpoint directory (complete or not), newest first."""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        except OSError:
            return []
        out = []
        for info in infos:
            name = info.base_name
            if info.type == pafs.FileType.Directory and name.startswith("step-") and name[5:].isdigit():
                out.append(int(name[5:]))
        return sorted(out, reverse=True)

    def load(self, step: int) -> tuple[list[dict], dict]:
        """Shards and manifest of one checkpoint, every checksum verified."""
        d = self._path(_dirname(step))
        try:
            with self.fs.open_input_stream(f"{d}/{MANIFEST}") as f:
                manifest = json.loads(f.read())
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {d} has no {MANIFEST}: it was not finished") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {d}: unreadable {MANIFEST}: {e}") from None
        shards = []
        for entry in manifest["files"]:
            try:
                with self.fs.open_input_stream(f"{d}/{entry['name']}") as f:
                    data = f.read()
            except OSError as e:
                raise CheckpointError(f"checkpoint {d}: cannot read {entry['name']}: {e}") from None
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise CheckpointError(
                    f"checkpoint {d}: {entry['name']} is corrupt (sha256 {hashlib.sha256(data).hexdigest()[:12]}.. "
                    f"!= manifest {entry['sha256'][:12]}.., {len(data)} bytes vs {entry['bytes']})")
            obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
            shards.append(_to_numpy(obj, step, entry["blocks"]))
        return shards, manifest

    def load_latest(self) -> tuple[list[dict], dict, list[str]] | None:
        """The newest checkpoint that verifies, and a note for each newer one that did not."""
        problems = []
        for step in self.steps():
            try:
                shards, manifest = self.load(step)
                return shards, manifest, problems
            except CheckpointError as e:
                problems.append(str(e))
        if problems:
            raise CheckpointError(f"no usable checkpoint in {self.uri}: " + "; ".join(problems))
        return None

    def prune(self, keep: int) -> None:
        """Delete all but the newest ``keep`` complete checkpoints (and older unfinished ones)."""
        complete = 0
        for step in self.steps():
            d = self._path(_dirname(step))
            done = self.fs.get_file_info(f"{d}/{MANIFEST}").type == pafs.FileType.File
            if done and complete < keep:
                complete += 1
                continue
            if complete >= keep:
                self.fs.delete_dir(d)

"""Reading a rank's own tensors from a torch distributed checkpoint (``model.init_from``).

A DCP folder (``.metadata`` and ``*.distcp`` files: what ``elastic-trainer
export --format dcp``, torchtitan or ``torch.distributed.checkpoint.save``
write) holds the model's parameters by global name, ``blocks.<index>.<name>``.
A rank asks ``torch.distributed.checkpoint.load`` for its own blocks' names
only, in its own process (``no_dist``: the run's process group is no part of
it), so it reads only the files, and the ranges of them, that hold those
tensors, straight into its parameters. Every name is checked against the
checkpoint's metadata first: a name it lacks, or a tensor of another shape, is
a ``ModelError`` naming the key, the shape there and the shape the block needs.

The ``.metadata`` file is a pickle, as torch writes it: give ``init_from`` only
a checkpoint whose source you trust.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from ..errors import ModelError
from .hf import TIED_ATTR

METADATA = ".metadata"


def is_dcp(folder: str | None) -> bool:
    """Whether ``folder`` is a local torch distributed checkpoint (holds ``.metadata``)."""
    return bool(folder) and os.path.isfile(os.path.join(os.path.expanduser(folder), METADATA))


class DCPWeights:
    """The tensors of the DCP folder ``folder``, by global name; ``opened``: the files read."""

    def __init__(self, folder: str):
        from torch.distributed.checkpoint import FileSystemReader

        self.folder = os.path.expanduser(folder)
        self.opened: set[str] = set()
        if not is_dcp(self.folder):
            have = sorted(os.listdir(self.folder))[:12] if os.path.isdir(self.folder) else "no such folder"
            raise ModelError(f"model.init_from({folder!r}): no {METADATA} there (found: {have}); a model.kind "
                             "other than 'hf' starts from a torch distributed checkpoint (elastic-trainer export "
                             "--format dcp writes one)")
        try:
            self.metadata = FileSystemReader(self.folder).read_metadata()
        except Exception as e:  # noqa: BLE001 - unreadable or not torch's; say which
            raise ModelError(f"model.init_from({folder!r}): {METADATA} is not readable: {e!r}") from None
        self.entries = self.metadata.state_dict_metadata

    def _found(self, name: str, block: nn.Module, local: str) -> str | None:
        if name in self.entries:
            return name
        tie = getattr(block, TIED_ATTR, {}).get(local)
        if tie is not None:   # a tied model's follower, saved once under its leader's name
            leader = f"blocks.{tie[0]}.{tie[1]}"
            return leader if leader in self.entries else None
        return None

    @torch.no_grad()
    def load_block(self, block: nn.Module, index: int, blocks: list[nn.Module]) -> None:
        """Fill block ``index``'s parameters (on the host) from the checkpoint; ``blocks``: every
        block of the model (as HFWeights takes it; a tie is named by the block itself here)."""
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        tensors: dict[str, torch.Tensor] = {}   # checkpoint name -> what it is read into
        targets: list[tuple[str, torch.Tensor]] = []   # (checkpoint name, parameter)
        for local, p in block.named_parameters():
            name = f"blocks.{index}.{local}"
            found = self._found(name, block, local)
            if found is None:
                raise ModelError(f"model.init_from({self.folder!r}): the checkpoint has no tensor {name!r} "
                                 f"(block {index}'s parameter {local!r}, shape {tuple(p.shape)}); it holds "
                                 f"{len(self.entries)} keys, e.g. {sorted(self.entries)[:4]}")
            md = self.entries[found]
            if not isinstance(md, TensorStorageMetadata):
                raise ModelError(f"model.init_from({self.folder!r}): {found!r} is not a tensor in the checkpoint "
                                 f"(block {index}'s parameter {local!r} needs one of shape {tuple(p.shape)})")
            if tuple(md.size) != tuple(p.shape):
                raise ModelError(f"model.init_from({self.folder!r}): tensor {found!r} has shape {tuple(md.size)} "
                                 f"in the checkpoint; block {index}'s parameter {local!r} needs {tuple(p.shape)}")
            # Straight into the parameter where the dtypes agree; else read as stored, then cast.
            same = md.properties.dtype == p.dtype and p.is_contiguous()
            if found not in tensors:
                tensors[found] = p.detach() if same else torch.empty(tuple(md.size), dtype=md.properties.dtype)
            targets.append((found, p))
        try:
            with warnings.catch_warnings():   # torch says it reads in one process: as asked
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp_load(tensors, storage_reader=FileSystemReader(self.folder), no_dist=True)
        except Exception as e:  # noqa: BLE001 - a missing or corrupt file; say which
            raise ModelError(f"model.init_from({self.folder!r}): reading block {index}'s tensors failed: {e!r}") from None
        self.opened.update(self._files(tensors))
        for found, p in targets:
            if tensors[found].data_ptr() != p.data_ptr():
                p.copy_(tensors[found].to(p.dtype))

    def _files(self, names) -> set[str]:
        storage = self.metadata.storage_data or {}
        return {getattr(info, "relative_path", str(info)) for idx, info in storage.items() if idx.fqn in names}

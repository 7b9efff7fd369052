"""Reading a rank's own tensors from a Hugging Face folder, and nothing else.

A ``save_pretrained`` folder holds either one ``model.safetensors`` or shards
named by ``model.safetensors.index.json``'s ``weight_map``. Files are opened
lazily (safetensors ``safe_open``, a memory map) and read tensor by tensor,
each cast to the master dtype as it is copied into its parameter; a rank
opens only the files that hold its blocks' tensors. A tied head whose tensor
the folder leaves out (tied models save it once) reads its leader's.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import torch
from torch import nn

from ..errors import ModelError
from .hf import HF_NAMES_ATTR, TIED_ATTR

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class HFWeights:
    """The tensors of the folder ``folder``, by Hugging Face name; ``opened``: the files read."""

    def __init__(self, folder: str):
        self.folder = os.path.expanduser(folder)
        self.opened: set[str] = set()
        index = os.path.join(self.folder, INDEX)
        single = os.path.join(self.folder, SINGLE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.weight_map: dict[str, str] = dict(json.load(f)["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ModelError(f"model.init_from({folder!r}): {INDEX} is not a readable index "
                                 f"with a weight_map: {e!r}") from None
        elif os.path.isfile(single):
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                self.weight_map = {k: SINGLE for k in f.keys()}
        else:
            have = sorted(os.listdir(self.folder))[:12] if os.path.isdir(self.folder) else "no such folder"
            raise ModelError(f"model.init_from({folder!r}): neither {SINGLE} nor {INDEX} there (found: {have}); "
                             "the weights are read as safetensors, which save_pretrained writes by default")

    def _name_in_files(self, hf_name: str) -> str | None:
        if hf_name in self.weight_map:
            return hf_name
        # A base model saved without its head's wrapper, or the reverse ("model." / "transformer.").
        head, _, rest = hf_name.partition(".")
        for other in (rest, f"model.{hf_name}", f"transformer.{hf_name}"):
            if other and other in self.weight_map:
                return other
        return None

    @torch.no_grad()
    def load_block(self, block: nn.Module, index: int, blocks: list[nn.Module]) -> None:
        """Fill block ``index``'s parameters (on the host) from the folder; ``blocks``: every
        block of the model (meta ones will do), to name a tied parameter's leader."""
        names = getattr(block, HF_NAMES_ATTR, {})
        ties = getattr(block, TIED_ATTR, {})
        by_file: dict[str, list[tuple[str, str, torch.Tensor]]] = defaultdict(list)
        for local, p in block.named_parameters():
            wanted = names.get(local)
            found = self._name_in_files(wanted) if wanted else None
            if found is None and local in ties:
                j, other = ties[local]
                wanted = getattr(blocks[j], HF_NAMES_ATTR, {}).get(other, wanted)
                found = self._name_in_files(wanted) if wanted else None
            if found is None:
                raise ModelError(f"model.init_from({self.folder!r}): block {index}'s parameter {local!r} "
                                 f"(Hugging Face name {wanted!r}) is in none of the folder's files "
                                 f"({sorted(set(self.weight_map.values()))})")
            by_file[self.weight_map[found]].append((found, local, p))
        from safetensors import safe_open

        for file, items in sorted(by_file.items()):
            path = os.path.join(self.folder, file)
            try:
                handle = safe_open(path, framework="pt")
            except Exception as e:  # noqa: BLE001 - a missing or corrupt file; say which
                raise ModelError(f"model.init_from({self.folder!r}): cannot open {file}: {e}") from None
            self.opened.add(file)
            with handle as f:
                for name, local, p in items:
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != tuple(p.shape):
                        raise ModelError(f"model.init_from({self.folder!r}): tensor {name!r} in {file} has shape "
                                         f"{shape}; block {index}'s parameter {local!r} needs {tuple(p.shape)}")
                    p.copy_(f.get_tensor(name).to(p.dtype))

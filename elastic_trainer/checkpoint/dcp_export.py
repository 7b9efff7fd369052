"""A run's checkpoint out as a torch distributed checkpoint (DCP):
``elastic-trainer export --format dcp SOURCE OUT``.

``torch.distributed.checkpoint.load`` reads the folder in any process, one or
many, no process group needed, into a state dict laid out as torchtitan
saves one:

- the model's parameters at the top level, by global name
  (``blocks.<index>.<name>``: what ``state_dict()`` of a module holding the
  blocks as ``self.blocks = nn.ModuleList(blocks)`` names them);
- AdamW's state under ``optimizer``, flattened as
  ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(...,
  options=StateDictOptions(flatten_optimizer_state_dict=True))`` gives it:
  ``optimizer.state.<name>.exp_avg``, ``.exp_avg_sq``, ``.step`` and
  ``optimizer.param_groups.<name>.<key>`` (``lr``: the rate of the step after
  the checkpoint's, as a resumed optimizer holds it; the other keys as
  ``train.*`` builds the optimizer). ``set_optimizer_state_dict`` with that
  option loads the ``optimizer`` part into a torch AdamW over those names.

Each part of the source becomes one file, ``__<k>_0.distcp`` for the
manifest's ``k``-th part, as if rank ``k`` had written it: the export holds
one part at a time, never the whole model. A slice of a sharded optimizer's
rank (``ranges``: flat elements ``[start, end)`` of a parameter) is written
as the chunks that tile it (``flat_boxes``), so no slice is put together with
another; a tensor that several parts hold whole is written once, by the
first. ``.metadata`` is written last, once every part is in.

SOURCE may also be a run's weights (its output folder, or a weights file):
the DCP then holds the model alone.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import warnings
from typing import Iterator

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (SavePlan, SavePlanner, TensorWriteData, WriteItem,
                                                  WriteItemType)

from ..config import ModelSection, TrainSection
from ..storage.uris import is_uri
from .hf_export import ExportError, export_source
from .slices import range_of
from .weights import iter_weights

OPTIMIZER = "optimizer"


def flat_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple, tuple, int, int]]:
    """The flat elements ``[start, end)`` of a row-major tensor of ``shape`` as boxes:
    ``[(offsets, sizes, flat start, flat end)]``. Each box is some leading indices held fixed,
    a run of one dimension, and the dimensions after it whole, so its elements are one run
    of the flat tensor: a slice of it, reshaped, is the box. At most ``2 * len(shape) - 1`` boxes."""
    if start >= end:
        return []
    if not shape:
        return [((), (), 0, 1)]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner   # the rows the range touches
    if first == last and (start % inner or end - first * inner < inner):
        # Inside one row: the row's own elements, one level down.
        return [((first, *o), (1, *s), first * inner + a, first * inner + b)
                for o, s, a, b in flat_boxes(shape[1:], start - first * inner, end - first * inner)]
    out = []
    lo = first
    if start % inner:   # the first row's tail
        out += flat_boxes(shape, start, (first + 1) * inner)
        lo = first + 1
    hi = last + 1 if end % inner == 0 else last   # rows held whole: [lo, hi)
    if hi > lo:
        out.append(((lo, *[0] * (len(shape) - 1)), (hi - lo, *shape[1:]), lo * inner, hi * inner))
    if end % inner:   # the last row's head
        out += flat_boxes(shape, max(start, last * inner), end)
    return out


def _tensor(a) -> torch.Tensor:
    a = np.asarray(a)
    t = torch.from_numpy(np.ascontiguousarray(a) if a.ndim else a.copy())   # (ascontiguousarray makes 0-d 1-d)
    return t.view(torch.bfloat16) if t.dtype == torch.int16 else t   # bf16 travels as its bits (dtypes.py)


class _PartPlanner(SavePlanner):
    """The chunks of one part, each with its data: what a rank's planner would hand the writer."""

    def __init__(self):
        self.items: list[WriteItem] = []
        self.data: dict[tuple, object] = {}
        self.planner_data: dict[str, tuple] = {}

    def add_tensor(self, fqn: str, path: tuple, shape: tuple, flat: torch.Tensor, start: int, end: int) -> None:
        """Elements ``[start, end)`` of the flattened tensor ``fqn`` of ``shape``; ``flat``: those elements."""
        whole = (start, end) == (0, math.prod(shape))
        for offsets, sizes, a, b in flat_boxes(tuple(shape), start, end):
            chunk = flat[a - start:b - start].reshape(sizes)
            index = MetadataIndex(fqn, torch.Size(offsets))
            self.items.append(WriteItem(
                index=index, type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                            properties=TensorProperties(dtype=flat.dtype), size=torch.Size(shape))))
            self.data[(fqn, tuple(offsets))] = chunk
        self.planner_data[fqn] = path

    def add_object(self, fqn: str, path: tuple, value) -> None:
        self.items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        self.data[(fqn, None)] = value
        self.planner_data[fqn] = path

    def drop(self, done: set) -> None:
        """Leave out the items another part already wrote (a tensor held whole by several)."""
        key = lambda it: (it.index.fqn, tuple(it.index.offset) if it.index.offset is not None else None)  # noqa: E731
        self.items = [it for it in self.items if key(it) not in done]
        done.update(key(it) for it in self.items)

    # SavePlanner's interface, as the writer calls it.
    def set_up_planner(self, state_dict=None, storage_meta=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self.items)

    def create_global_plan(self, all_plans):
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self.data[(write_item.index.fqn, None)], buf)
            buf.seek(0)
            return buf
        return self.data[(write_item.index.fqn, tuple(write_item.index.offset))]


def _param_groups(train: TrainSection, step: int, shapes: dict[str, tuple]) -> dict[str, dict]:
    """Each name's param group but ``params``, as the run's optimizer holds it after ``step``: the
    optimizer ``train`` names, built over the names on the meta device (groups go by name)."""
    from ..lr_schedule import lr_at
    from ..optim.build import build_optimizer

    params = [(n, torch.empty(shape, device="meta", requires_grad=True)) for n, shape in shapes.items()]
    if not params:
        return {}
    names = {id(t): n for n, t in params}
    out = {}
    for group in build_optimizer(params, train).param_groups:
        values = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        values["lr"] = lr_at(train, step + 1) * group.get("lr_ratio", 1.0)   # as lr_schedule.set_lr sets it
        out.update({names[id(p)]: values for p in group["params"]})
    return out


def _plan_shard(shard: dict, train: TrainSection | None) -> _PartPlanner:
    """One durable part (numpy, as ``DurableStore.read_part`` gives it) as DCP chunks; the
    optimizer's param groups with it where ``train`` is given."""
    planner = _PartPlanner()
    ranges = shard.get("ranges") or {}
    shapes = {name: (tuple(int(d) for d in ranges[name][2]) if name in ranges else tuple(np.shape(a)))
              for name, a in shard["params"].items()}
    groups = _param_groups(train, shard["step"], shapes) if train is not None else {}
    for name, a in shard["params"].items():
        shape = shapes[name]
        start, end = range_of(shard, name)
        planner.add_tensor(name, (name,), shape, _tensor(a).reshape(-1), start, end)
        for key, v in (shard["optim"].get(name) or {}).items():
            fqn, path, t = f"{OPTIMIZER}.state.{name}.{key}", (OPTIMIZER, f"state.{name}.{key}"), _tensor(v)
            if t.dim() == 0:
                planner.add_tensor(fqn, path, (), t.reshape(-1), 0, 1)
                continue
            s, e = range_of(shard, name, optim=True)
            if t.numel() == e - s:   # shaped as the parameter (whole, or a sharded rank's slice of it)
                planner.add_tensor(fqn, path, shape, t.reshape(-1), s, e)
            elif name not in ranges:   # a state of its own shape (a factored second moment)
                planner.add_tensor(fqn, path, tuple(t.shape), t.reshape(-1), 0, t.numel())
            else:
                raise ExportError(f"{name}: its optimizer state {key!r} holds {t.numel()} elements in a slice "
                                  f"[{s}, {e}) of the parameter: no layout to write it in")
        for key, v in groups.get(name, {}).items():
            planner.add_object(f"{OPTIMIZER}.param_groups.{name}.{key}", (OPTIMIZER, f"param_groups.{name}.{key}"), v)
    return planner


def _plan_weights(state: dict[str, torch.Tensor]) -> _PartPlanner:
    planner = _PartPlanner()
    for name, t in state.items():
        planner.add_tensor(name, (name,), tuple(t.shape), t.reshape(-1), 0, t.numel())
    return planner


def _parts(source: str) -> tuple[ModelSection, int, Iterator[_PartPlanner]]:
    """(model, number of parts, each part's planner in turn) of a durable checkpoint directory or
    a run's weights."""
    src = export_source(source)
    if src.manifest is not None:
        store, name, manifest = src.store, src.name, src.manifest
        cfg = manifest["config"]
        train = TrainSection.model_validate(cfg["train"])
        files = manifest["files"]
        parts = (_plan_shard(store.read_part(name, entry, manifest["step"]), train) for entry in files)
        return ModelSection.model_validate(cfg["model"]), len(files), parts
    return (ModelSection.model_validate(src.meta["model"]), src.n_files,
            (_plan_weights(s) for s in iter_weights(source)))


def _check_whole(metadata) -> None:
    """Every tensor's chunks together hold all of it (the parts cover the model)."""
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            held = sum(math.prod(c.sizes) for c in md.chunks)
            if held != math.prod(md.size):
                raise ExportError(f"{fqn}: the parts hold {held} of its {math.prod(md.size)} elements; "
                                  "a part of the checkpoint is missing, no .metadata written")


def export_dcp(source: str, out_dir: str) -> str:
    """Write ``source`` (a durable checkpoint directory, or a run's weights) as a torch distributed
    checkpoint in the local folder ``out_dir``: one ``__<k>_0.distcp`` per part of the source,
    then ``.metadata``. The folder's path."""
    if is_uri(out_dir):
        raise ExportError(f"--format dcp writes a local folder (torch's FileSystemWriter); {out_dir!r} is a URI: "
                          "export to a local path, then copy it")
    _, n, parts = _parts(source)
    out = os.path.abspath(os.path.expanduser(out_dir))
    with contextlib.suppress(FileNotFoundError):
        # An earlier export here stops being a checkpoint until this one's .metadata is in: its
        # metadata would name files this export is replacing.
        os.remove(os.path.join(out, ".metadata"))
    writer = FileSystemWriter(out, single_file_per_rank=True, thread_count=1)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    done: set = set()
    plans, results, planner_data = [], [], {}
    for k, planner in enumerate(parts):
        planner.drop(done)
        plan = SavePlan(planner.items, storage_data=_StoragePrefix(f"__{k}_"))
        with warnings.catch_warnings():   # an earlier export in the same folder is overwritten, as --hf does
            warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
            plan = writer.prepare_local_plan(plan)
        results.append(writer.write_data(plan, planner).value())
        plans.append(SavePlan(plan.items))
        planner_data.update(planner.planner_data)
        del planner, plan   # the part's tensors go before the next is read
    if len(plans) != n:
        raise ExportError(f"{source!r}: {len(plans)} of its {n} parts read")
    _, metadata = create_default_global_save_plan(plans)
    _check_whole(metadata)
    metadata.planner_data = planner_data
    with contextlib.suppress(AttributeError):
        metadata.storage_meta = writer.storage_meta()
    writer.finish(metadata, results)
    return out

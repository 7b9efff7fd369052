"""What the planner needs to know about a model: parameter shapes per block and the bytes one micro-batch makes.

Everything is measured on the meta device: the blocks are built and run on
one micro-batch of token ids with no memory and no arithmetic. Two byte
counts come out per block:

- ``out_bytes``: its output, which is what crosses a pipeline boundary (and
  what a stage keeps until that output's gradient comes back);
- ``saved_bytes``: the tensors autograd saves for backward (caught with
  ``torch.autograd.graph.saved_tensors_hooks``), counted once per storage
  and without the block's own parameters and buffers, which are state, not
  activations. The loss's saved tensors count to the last block, whose stage
  computes it. On meta, ``scaled_dot_product_attention`` runs its math
  kernel, which saves the ``T x T`` attention probabilities; the fused
  kernels a real device picks save less, so for attention the count errs
  on the safe side.

A model whose forward does not run on meta tensors (it reads values, say)
gets ``None`` for both, with the reason in ``why``.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from ..config import ModelSection, TrainerConfig
from ..models.factory import build_blocks_for_shapes


@dataclass(frozen=True)
class ModelShape:
    """A model's blocks as the planner sees them; see the module docstring for the byte counts."""

    param_shapes: tuple[tuple[tuple[int, ...], ...], ...]  # per block, in ``parameters()`` order
    out_bytes: tuple[int, ...] | None  # per block, one micro-batch
    saved_bytes: tuple[int, ...] | None  # per block, one micro-batch
    why: str | None = None  # why the byte counts are None
    note: str = ""  # what the byte counts leave out

    @property
    def param_counts(self) -> list[int]:
        """Parameters per block."""
        return [sum(math.prod(s) for s in block) for block in self.param_shapes]


def model_shape(cfg: TrainerConfig) -> ModelShape:
    """The shape of ``cfg``'s model at its micro-batch and sequence length.

    Cached on the model section, micro-batch and sequence length: the re-plan
    after a failure asks again on the recovery path, and building and running
    the model even on meta tensors takes tens of milliseconds (and, in a
    process that has not yet, the first meta op imports ``torch._dynamo``:
    1.2 s).
    """
    key = _key(cfg)
    with _LOCK:
        known = _MEASURED.get(key)
    if known is None:
        known = _measure(*key)
        with _LOCK:
            _MEASURED[key] = known
    return known


def remember_shape(cfg: TrainerConfig, shape: ModelShape) -> None:
    """Take ``shape`` as ``cfg``'s model shape, measured in another process (the driver's, which
    the controller is handed it by, so that the controller need not import dynamo to measure it)."""
    if not isinstance(shape, ModelShape):
        raise TypeError(f"a ModelShape is needed, not {type(shape).__name__}")
    with _LOCK:
        _MEASURED[_key(cfg)] = shape


class ShapeInBackground:
    """``model_shape(cfg)`` measured on a thread of the driver's while it connects to the cluster,
    for the controller to be handed (``remember_shape``): a driver that has trained or measured
    before has dynamo loaded, and a new one measures beside ``ray.init``, where the controller
    would measure beside its workers' start, on the same cores. For the built-in models built
    from their config only: a user's factory, or weights to load (``model.init_from``), may be
    built for real where the meta device will not do, and the driver is no place for the whole
    model; the controller measures those as before."""

    def __init__(self, cfg: TrainerConfig):
        self.shape: ModelShape | None = None
        self._thread = None
        if cfg.model.kind == "gpt" or (cfg.model.kind == "hf" and not cfg.model.init_from):
            self._thread = threading.Thread(target=self._measure, args=(cfg,), name="model-shape", daemon=True)
            self._thread.start()

    def _measure(self, cfg: TrainerConfig) -> None:
        try:
            self.shape = model_shape(cfg)
        except Exception:  # noqa: BLE001 - the controller measures it again and reports what fails
            self.shape = None

    def result(self) -> ModelShape | None:
        """The shape, once measured; None where it was not (the controller then measures it)."""
        if self._thread is not None:
            self._thread.join()
        return self.shape


def _key(cfg: TrainerConfig) -> tuple[str, int, int]:
    return cfg.model.model_dump_json(), cfg.train.micro_batch_size, cfg.data.seq_len


_LOCK = threading.Lock()
_MEASURED: dict[tuple[str, int, int], ModelShape] = {}


def _measure(model_json: str, micro_batch: int, seq_len: int) -> ModelShape:
    model = ModelSection.model_validate_json(model_json)
    blocks, loss_fn, on_meta = build_blocks_for_shapes(model)
    if not on_meta:
        # Running a real build's forward would cost real compute and memory: shapes only.
        shapes = tuple(tuple(tuple(p.shape) for p in b.parameters()) for b in blocks)
        return ModelShape(shapes, None, None, why="the factory cannot build on the meta device")
    with torch.device("meta"):
        shapes = tuple(tuple(tuple(p.shape) for p in b.parameters()) for b in blocks)
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        try:
            x, out, saved = ids, [], []
            for b in blocks:
                with _SavedBytes(list(b.parameters()) + list(b.buffers())) as s:
                    x = b(x)
                if not isinstance(x, torch.Tensor):
                    raise TypeError(f"block {type(b).__name__} returned {type(x).__name__}, not a tensor")
                out.append(x.numel() * x.element_size())
                saved.append(s.nbytes)
        except Exception as e:  # any model code may fail on meta tensors
            return ModelShape(shapes, None, None, why=f"{type(e).__name__}: {e}")
        note = ""
        try:
            with _SavedBytes(list(loss_fn.parameters()) if isinstance(loss_fn, torch.nn.Module) else []) as s:
                loss_fn(x, ids)
            saved[-1] += s.nbytes
        except Exception as e:  # a loss with other targets than token ids, or that reads values
            note = f"the loss's saved tensors are left out ({type(e).__name__}: {e})"
    return ModelShape(shapes, tuple(out), tuple(saved), note=note)


class _SavedBytes:
    """Bytes of the distinct storages autograd saves while active, except those of ``exclude``."""

    def __init__(self, exclude: list[torch.Tensor]):
        # A storage's identity: on the meta device every data pointer is 0, so
        # the storage object's own handle is what tells two tensors apart.
        self._exclude = {t.untyped_storage()._cdata for t in exclude}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @property
    def nbytes(self) -> int:
        return sum(self._seen.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in self._exclude:
            # A view saves its base's whole storage: that is what stays allocated.
            self._seen[storage._cdata] = storage.nbytes()
        return t

    def __enter__(self) -> "_SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

"""Tensors of any dtype as numpy arrays, and back, bit for bit.

Shards hold numpy arrays (the object store maps them without copying), and
numpy has no bfloat16. A bfloat16 tensor travels as its bits, viewed as
int16; no parameter or optimizer moment is ever int16, so a reader that knows
the live tensor's dtype views the bits back (:func:`as_tensor`). Every other
dtype torch shares with numpy (float32, float16, float64, ...) is itself.
"""

from __future__ import annotations

import numpy as np
import torch

# dtype -> the integer dtype of the same width its bits travel as
_BITS_AS = {torch.bfloat16: torch.int16}


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of ``dtype`` is stored as: itself, or an integer of its width."""
    return _BITS_AS.get(dtype, dtype)


def to_numpy(t: torch.Tensor, copy: bool = True) -> np.ndarray:
    """``t`` as a numpy array: a copy on the host, or with ``copy=False`` (CPU tensors) a view of it."""
    t = t.detach()
    if t.dtype in _BITS_AS:
        t = t.view(_BITS_AS[t.dtype])
    return t.to("cpu", copy=True).numpy() if copy else t.numpy()


def as_tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """An array written by :func:`to_numpy` as a tensor to be loaded into one of ``dtype`` (no copy)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if _BITS_AS.get(dtype) == t.dtype:
        t = t.view(dtype)
    return t


_NUMPY: dict = {}


def numpy_dtype(dtype: torch.dtype, name: str = "a tensor") -> np.dtype:
    """The numpy dtype of a torch ``dtype`` that numpy has (a stored dtype: ``bits_dtype``)."""
    if dtype not in _NUMPY:
        try:
            _NUMPY[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError as e:
            raise TypeError(f"{name}: {dtype} has no numpy equivalent; snapshots hold numpy arrays "
                            f"(float32, float16, float64, bfloat16 work)") from e
    return _NUMPY[dtype]

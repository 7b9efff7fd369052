"""Lending live tensors to a reader, with a signal for when the reader is done.

A rank that writes its whole state into the object store need not copy it
first: the part it hands to Ray can hold views of the live parameters and
optimizer moments, and Ray's write into the object store is then the only
copy. Those tensors must not change until that write is over, and Ray says
nothing when it is. A ``TensorLoan`` makes the views itself, each backed by a
small buffer object of its own; every array, view or pickle buffer derived
from a view keeps that object alive, so when the last of them goes the
reader is done, and ``wait`` returns. The loan also keeps the tensors
alive until then (the views do not own their memory).
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np
import torch

from .dtypes import bits_dtype, numpy_dtype


# Tensors smaller than this are copied at once instead of lent.
LEND_MIN_BYTES = 64 << 10


class TensorLoan:
    """Views of live CPU tensors, and a wait for the moment none is referenced any more."""

    def __init__(self):
        self._out = 0
        self._lock = threading.Lock()
        self._free = threading.Event()
        self._free.set()

    def view(self, t: torch.Tensor) -> np.ndarray:
        """A read-only numpy view of CPU tensor ``t`` (bfloat16 as its bits, like ``dtypes.to_numpy``)."""
        t = t.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"a tensor loan lends contiguous CPU tensors only, not {t.device} "
                             f"{'contiguous' if t.is_contiguous() else 'strided'} ones")
        bits = bits_dtype(t.dtype)
        if bits is not t.dtype:
            t = t.view(bits)
        if t.nbytes < LEND_MIN_BYTES:
            # Copying a small tensor (AdamW's step counters, biases, norms) costs less than
            # watching a view of it; the copy is what the object store will read.
            return t.numpy().copy()
        holder = (ctypes.c_char * t.nbytes).from_address(t.data_ptr())
        with self._lock:
            self._out += 1
            self._free.clear()
        weakref.finalize(holder, self._returned, t)  # holds t until the last view goes
        arr = np.frombuffer(holder, dtype=numpy_dtype(t.dtype)).reshape(t.shape)
        arr.flags.writeable = False
        return arr

    def _returned(self, _tensor) -> None:
        with self._lock:
            self._out -= 1
            if self._out == 0:
                self._free.set()

    @property
    def outstanding(self) -> int:
        """Views (with what derives from them) still referenced somewhere."""
        with self._lock:
            return self._out

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no view is referenced; False if ``timeout`` passed first."""
        return self._free.wait(timeout)

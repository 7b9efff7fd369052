"""Comm state leaving its device: snapshots hold host numpy arrays, whatever device the state lives on."""

from __future__ import annotations

import numpy as np
import torch


def host_array(t: torch.Tensor) -> np.ndarray:
    """A host numpy copy of ``t`` from any device (bfloat16, which numpy lacks, as float32)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.to("cpu", copy=True).numpy()

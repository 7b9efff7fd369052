"""Building on the meta device without running initialisers there."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# In-place initialisers that give a meta tensor nothing but its own shape back.
_INIT_METHODS = frozenset(getattr(torch.Tensor, n) for n in (
    "normal_", "uniform_", "erfinv_", "log_normal_", "exponential_", "cauchy_", "geometric_", "bernoulli_",
    "random_"))


class _NoInitOnMeta(TorchFunctionMode):
    """Skips initialisers on meta tensors. Random ones (``normal_``, as every ``nn.Embedding``
    and GPT-2-style init calls) run torch's Python reference kernels there, and their first call
    imports ``torch._dynamo``: 1.2 s of the controller's start, before any worker was placed,
    to count parameters that are the same without them."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INIT_METHODS or getattr(func, "__module__", None) == "torch.nn.init":
            t = args[0] if args else kwargs.get("tensor")   # torch.nn.init passes it by name
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def no_init_on_meta() -> TorchFunctionMode:
    """A mode under which initialisers leave meta tensors alone (see ``_NoInitOnMeta``)."""
    return _NoInitOnMeta()

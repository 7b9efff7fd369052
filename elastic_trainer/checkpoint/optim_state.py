"""Any optimizer's per-parameter state back into live tensors, each as the optimizer itself keeps it.

A snapshot carries ``optimizer.state[p]`` by parameter name as arrays: tensors of the
parameter's shape (AdamW's ``exp_avg``, SGD's ``momentum_buffer``), scalar counters
(``step``, NAdam's ``mu_product``, ASGD's ``eta``) and, for an optimizer that is not
elementwise, tensors of other shapes (Adafactor's ``row_var`` / ``col_var``), carried whole.

Where each comes back to matters on a GPU: torch's optimizers keep some counters on the
CPU (Adam's ``step``, read as a number each step) and some on the parameter's device (ASGD's,
or any under ``capturable`` / ``fused``), and a counter on the wrong device fails or stalls
the step. Rather than a table per class, the placement is read off the optimizer's class
itself: a throwaway instance with the parameter's group arguments takes one step on a
two-element probe of the parameter's rank and device, and each state entry it makes says
its dtype and device (cached per class, device, rank and group arguments). Where the probe
cannot run (a user class that needs more than a zero gradient) the older rule holds:
counters as torch's Adam keeps ``step`` (``state.step_placement``), tensors as the parameter.
"""

from __future__ import annotations

import numpy as np
import torch

from .dtypes import as_tensor
from .slices import owned_array

_PLACEMENT: dict = {}


def _group_key(group: dict) -> tuple:
    # The rate changes every step and places nothing: left out, so one probe serves a whole run.
    return tuple(sorted((k, repr(v)) for k, v in group.items() if k not in ("params", "lr", "lr_ratio")))


def placement(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor) -> dict[str, tuple]:
    """``{state key: (dtype, device)}`` of what ``optimizer``'s class keeps for a parameter like ``p``
    in param group ``group`` ({} where the probe cannot run)."""
    key = (type(optimizer), str(p.device), p.dim(), p.dtype, _group_key(group))
    if key not in _PLACEMENT:
        out: dict = {}
        try:
            probe = torch.zeros((2,) * p.dim(), dtype=p.dtype, device=p.device, requires_grad=True)
            probe.grad = torch.zeros_like(probe)
            opts = {k: v for k, v in group.items() if k != "params"}
            opt = type(optimizer)([{"params": [probe], **opts}], **({"lr": opts["lr"]} if "lr" in opts else {}))
            opt.step()
            out = {k: (v.dtype, v.device) for k, v in opt.state[probe].items() if torch.is_tensor(v)}
        except Exception:  # noqa: BLE001 - any class's step may refuse a probe: the fallback rule holds
            out = {}
        _PLACEMENT[key] = out
    return _PLACEMENT[key]


def is_counter(key: str, value, p: torch.Tensor) -> bool:
    """Whether state entry ``key`` is a scalar counter rather than a tensor of the parameter's shape
    (a 0-d entry of a parameter that is not 0-d; ``step`` always)."""
    return key == "step" or (np.ndim(value) == 0 and p.dim() > 0)


def state_tensors(optimizer: torch.optim.Optimizer, group: dict, p: torch.Tensor, entries: dict) -> dict:
    """``optimizer.state[p]`` from ``entries`` (``{key: array or number}``, shaped as they are to be
    held: the caller reshapes an elementwise entry to ``p``'s shape), each on its dtype and device."""
    from .state import step_placement

    where = placement(optimizer, group, p)
    out = {}
    for k, v in entries.items():
        if k in where:
            dtype, device = where[k]
        elif is_counter(k, v, p):
            dtype, device = step_placement(p.device, group)
        else:
            dtype, device = p.dtype, p.device
        if is_counter(k, v, p):
            out[k] = torch.from_numpy(np.array(v, dtype=np.float64).reshape(())).to(dtype=dtype, device=device)
        else:
            out[k] = as_tensor(owned_array(v), dtype).to(device)
    return out

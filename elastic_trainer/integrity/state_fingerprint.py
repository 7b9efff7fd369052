"""Fingerprints of a rank's training state, cheap enough to take every few steps on the device.

A tensor's fingerprint is the sum, as int64 (wrapping), of its elements' bit patterns read as
integers of their width. One flipped bit changes its element's pattern by a power of two, and so
the sum: every single-bit flip is seen, and two flips cancel only where they are the same bit
with opposite signs in two elements. A permutation of elements is not seen (corruption does not
permute). It reads each byte once, on the tensor's own device, and the rank's whole state comes
to the host in one transfer.

Replicas of a stage hold bit-identical parameters (and, unsharded, optimizer state) after a
step of ``comm.sync: allreduce``, so their fingerprints are equal unless something corrupted
one of them. Unlike ``checkpoint.fingerprint`` (layout-free, for restores, on the host), these
compare only the same tensors in the same layout.

Torch only.
"""

from __future__ import annotations

import torch

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_sum(t: torch.Tensor) -> torch.Tensor:
    """``t``'s fingerprint, as a 0-d int64 tensor on its device."""
    t = t.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.contiguous().view(_INT[t.element_size()]).sum(dtype=torch.int64)


def state_fingerprint(named_params, optimizer, owned: dict | None = None, optim: bool = True,
                      params: bool = True) -> dict[str, int]:
    """``{"name|param": int, "name|<state key>": int}`` of a rank's parameters (with ``params``) and
    (with ``optim``) the optimizer state it holds: each parameter's own (``owned`` None), or that of
    the slices it owns (``owned``: name -> the tensor the optimizer steps, a sharded optimizer's)."""
    keys, sums = [], []
    for n, p in named_params:
        if params:
            keys.append(f"{n}|param")
            sums.append(bits_sum(p))
        if not optim:
            continue
        key = p if owned is None else owned.get(n)
        for k, v in (optimizer.state.get(key) or {} if key is not None else {}).items():
            if torch.is_tensor(v):
                keys.append(f"{n}|{k}")
                sums.append(bits_sum(v.to(p.device)))
    if not sums:
        return {}
    return dict(zip(keys, torch.stack(sums).tolist()))


def differing(a: dict[str, int], b: dict[str, int]) -> list[str]:
    """The keys whose fingerprints differ (or that one of the two lacks), sorted."""
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))

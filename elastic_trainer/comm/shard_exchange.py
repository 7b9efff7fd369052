"""Reduce-scatter and all-gather of equal shards, what a sharded optimizer sends.

A sharded step (``parallel.shard_optimizer``) replaces each bucket's
all-reduce by a reduce-scatter of its gradients (every rank gets the sum of
its own 1/p) and, after the update, an all-gather of the parameters. Together
they send what the ring all-reduce does: ``2(p-1)/p * N``.

The backend's collectives are used where it has them. Where it does not
(gloo before torch 2.x has no reduce-scatter; some builds have neither
``*_single`` nor ``*_tensor`` forms), both are built from what every backend
has, as the int8 codec is: an all-to-all of the p shards, summed locally, and
an all-gather of a list.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .stats import CommStats
from .timing import start_timer


def shard_bytes_sent(nbytes: int, p: int) -> int:
    """Bytes one rank sends in a reduce-scatter (or an all-gather) of ``nbytes`` over ``p`` ranks."""
    return (p - 1) * nbytes // p


def _backend_fn(*names: str):
    """The first of these ``torch.distributed`` functions this build has (torch renamed them)."""
    return next((getattr(dist, n) for n in names if hasattr(dist, n)), None)


class ShardExchange:
    """Reduce-scatter and all-gather over one group of ``p`` ranks. ``built``: always use the forms
    built from all-to-all and all-gather (for backends without their own; a test forces it)."""

    def __init__(self, group, p: int, built: bool = False):
        self.group, self.p = group, p
        self._rs = None if built else _backend_fn("reduce_scatter_single", "reduce_scatter_tensor")
        self._ag = None if built else _backend_fn("all_gather_single", "all_gather_into_tensor")

    def reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor, stats: CommStats | None = None) -> None:
        """``out`` (``flat.numel() / p`` elements) becomes the sum over the group of this rank's
        1/p of ``flat``. ``flat`` is padded by the caller to a multiple of ``p``."""
        if flat.numel() != out.numel() * self.p:
            raise ValueError(f"reduce-scatter of {flat.numel()} elements over {self.p} ranks into {out.numel()}: "
                             f"the input must be exactly p x the output")
        timer = start_timer(flat.device)
        if self.p == 1:
            out.copy_(flat)
        elif self._rs is not None:
            try:
                self._rs(out, flat, op=dist.ReduceOp.SUM, group=self.group)
            except RuntimeError as e:
                if "not supported" not in str(e).lower():
                    raise
                self._rs = None   # this backend has the call but not for this case: built from now on
                self._built_rs(flat, out)
        else:
            self._built_rs(flat, out)
        if stats is not None:
            stats.add("reduce_scatter", shard_bytes_sent(flat.numel() * flat.element_size(), self.p), timer.stop())

    def _built_rs(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        recv = torch.empty_like(flat)
        dist.all_to_all_single(recv, flat, group=self.group)
        torch.sum(recv.view(self.p, -1), dim=0, out=out)

    def all_gather(self, shard: torch.Tensor, out: torch.Tensor, stats: CommStats | None = None) -> None:
        """``out`` (``p`` x ``shard``) becomes every rank's ``shard`` in group-rank order."""
        if out.numel() != shard.numel() * self.p:
            raise ValueError(f"all-gather of {shard.numel()} elements over {self.p} ranks into {out.numel()}: "
                             f"the output must be exactly p x the input")
        timer = start_timer(shard.device)
        if self.p == 1:
            out.copy_(shard)
        elif self._ag is not None:
            self._ag(out, shard, group=self.group)
        else:
            dist.all_gather(list(out.view(self.p, -1).unbind(0)), shard, group=self.group)
        if stats is not None:
            stats.add("all_gather", shard_bytes_sent(out.numel() * out.element_size(), self.p), timer.stop())

"""Local SGD and DiLoCo: replicas train alone for ``comm.local_steps`` steps, then meet.

``local_sgd`` averages the parameters. ``diloco`` (Douillard et al. 2023)
keeps an outer copy of the parameters from the last meeting; the averaged
change since then is the outer gradient, applied with Nesterov momentum
(``comm.outer_lr``, ``comm.outer_momentum``), and every replica restarts from
the new outer parameters. Each replica's inner optimizer state stays its own.

Communication per meeting is one fp32 all-reduce of the stage's parameters,
against one of its gradients every step for ``allreduce``: ``local_steps``
times fewer bytes. With ``comm.compression`` fp16 or bf16 a meeting sends,
at 2 bytes an element, each replica's change since the last meeting instead
(``local_sgd`` then keeps that meeting's parameters too): half the bytes,
for a rounding of the change only, never of the weights themselves, as
DiLoCo's reduced-precision outer gradients. The sum is taken of changes
already divided by the replicas, so fp16's range holds wherever a change does.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..config import CommSection
from .algorithms import ring_allreduce_bytes
from .stats import CommStats
from .host import host_array
from .timing import start_timer


class ModelAverager:
    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], group, group_size: int,
                 comm: CommSection):
        self.named = named_params
        self.group, self.p, self.comm = group, group_size, comm
        self.diloco = comm.sync == "diloco"
        # A meeting in 2-byte floats sends changes since the last meeting, so it keeps that one's parameters.
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(comm.compression)
        self.anchored = self.diloco or (self.dtype is not None and group_size > 1)
        # The last meeting's parameters (DiLoCo's outer ones) and DiLoCo's momentum, by parameter
        # name so they restore into any layout.
        self.outer: dict[str, torch.Tensor] = {}
        self.momentum: dict[str, torch.Tensor] = {}
        if self.anchored:
            self._reset_outer()

    def _reset_outer(self) -> None:
        self.outer = {n: p.detach().clone() for n, p in self.named}
        self.momentum = {n: torch.zeros_like(p) for n, p in self.named} if self.diloco else {}

    def is_sync_step(self, step: int) -> bool:
        return step % self.comm.local_steps == 0

    def maybe_sync(self, step: int, stats: CommStats) -> float:
        """At a meeting step, average (local SGD) or take the outer step (DiLoCo); returns seconds."""
        if not self.is_sync_step(step):
            return 0.0
        params = [p for _, p in self.named]
        whole = start_timer(params[0].device) if params else None
        with torch.no_grad():
            if self.anchored:
                flat = torch.cat([(self.outer[n] - p.detach()).reshape(-1) for n, p in self.named])
            else:
                flat = torch.cat([p.detach().reshape(-1) for p in params])
            if self.p > 1:
                timer = start_timer(flat.device)
                sent = flat.div(self.p).to(self.dtype) if self.dtype is not None else flat
                dist.all_reduce(sent, group=self.group)
                stats.add("all_reduce", ring_allreduce_bytes(sent.numel() * sent.element_size(), self.p),
                          timer.stop())
                if sent is flat:
                    flat.div_(self.p)
                else:
                    flat.copy_(sent)
            offset = 0
            for name, p in self.named:
                part = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                if self.diloco:
                    # Nesterov on the outer gradient (the averaged drift since the last meeting).
                    m = self.momentum[name]
                    m.mul_(self.comm.outer_momentum).add_(part)
                    self.outer[name].sub_(part.add(m, alpha=self.comm.outer_momentum), alpha=self.comm.outer_lr)
                    p.copy_(self.outer[name])
                elif self.anchored:
                    # The last meeting's parameters less the mean change: the replicas' mean.
                    self.outer[name].sub_(part)
                    p.copy_(self.outer[name])
                else:
                    p.copy_(part)
        return whole.stop().seconds() if whole is not None else 0.0

    # -- state carried by snapshots (taken at meeting steps, where replicas agree; local SGD's
    # last meeting's parameters are then the parameters themselves) --
    def export_state(self) -> dict:
        if not self.diloco:
            return {}
        return {"outer": {n: host_array(t) for n, t in self.outer.items()},
                "momentum": {n: host_array(t) for n, t in self.momentum.items()}}

    def load_state(self, saved: dict | None) -> None:
        """After the parameters are loaded: the outer state saved, else the parameters as the last meeting's."""
        if not self.anchored:
            return
        self._reset_outer()
        if not self.diloco:
            return
        for key, target in (("outer", self.outer), ("momentum", self.momentum)):
            for name, value in (saved or {}).get(key, {}).items():
                if name in target:
                    target[name].copy_(torch.from_numpy(np.array(value)))

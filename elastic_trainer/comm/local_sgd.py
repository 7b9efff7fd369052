"""Local SGD and DiLoCo: replicas train alone for ``comm.local_steps`` steps, then meet.

``local_sgd`` averages the parameters. ``diloco`` (Douillard et al. 2023)
keeps an outer copy of the parameters from the last meeting; the averaged
change since then is the outer gradient, applied with Nesterov momentum
(``comm.outer_lr``, ``comm.outer_momentum``), and every replica restarts from
the new outer parameters. Each replica's inner optimizer state stays its own.

Communication per meeting is one fp32 all-reduce of the stage's parameters,
against one of its gradients every step for ``allreduce``: ``local_steps``
times fewer bytes.
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
        # DiLoCo's outer state, by parameter name so it restores into any layout.
        self.outer: dict[str, torch.Tensor] = {}
        self.momentum: dict[str, torch.Tensor] = {}
        if self.diloco:
            self._reset_outer()

    def _reset_outer(self) -> None:
        self.outer = {n: p.detach().clone() for n, p in self.named}
        self.momentum = {n: torch.zeros_like(p) for n, p in self.named}

    def is_sync_step(self, step: int) -> bool:
        return step % self.comm.local_steps == 0

    def maybe_sync(self, step: int, stats: CommStats) -> float:
        """At a meeting step, average (local SGD) or take the outer step (DiLoCo); returns seconds."""
        if not self.is_sync_step(step):
            return 0.0
        params = [p for _, p in self.named]
        whole = start_timer(params[0].device) if params else None
        with torch.no_grad():
            if self.diloco:
                flat = torch.cat([(self.outer[n] - p.detach()).reshape(-1) for n, p in self.named])
            else:
                flat = torch.cat([p.detach().reshape(-1) for p in params])
            if self.p > 1:
                timer = start_timer(flat.device)
                dist.all_reduce(flat, group=self.group)
                stats.add("all_reduce", ring_allreduce_bytes(flat.numel() * flat.element_size(), self.p),
                          timer.stop())
                flat.div_(self.p)
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
                else:
                    p.copy_(part)
        return whole.stop().seconds() if whole is not None else 0.0

    # -- state carried by snapshots (taken at meeting steps, where replicas agree) --
    def export_state(self) -> dict:
        if not self.diloco:
            return {}
        return {"outer": {n: host_array(t) for n, t in self.outer.items()},
                "momentum": {n: host_array(t) for n, t in self.momentum.items()}}

    def load_state(self, saved: dict | None) -> None:
        if not self.diloco:
            return
        self._reset_outer()
        for key, target in (("outer", self.outer), ("momentum", self.momentum)):
            for name, value in (saved or {}).get(key, {}).items():
                if name in target:
                    target[name].copy_(torch.from_numpy(np.array(value)))

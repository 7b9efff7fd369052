"""A rank's side of each step's verdict (``integrity``): what it adds to the one small all-reduce,
how the step is judged, and the clipping that reads the same norm.

The verdict replaces the collectives that clipping (the norm over the pipeline, or the world
under a sharded optimizer) and fp16's overflow check each ran before: a step sends one
all-reduce of ``2 + slots + world`` floats, whatever of them it needs.
"""

from __future__ import annotations

import torch

from ..comm.stats import CommStats
from ..comm.timing import start_timer
from ..config import TrainerConfig
from ..integrity.anomaly import AnomalyJudge
from ..integrity.verdict import Verdict, agree, local_sq
from ..parallel.topology import Topology


class StepCheck:
    """One rank's verdicts: ``agree`` a step, ``judge`` it, ``clip`` by its norm."""

    def __init__(self, cfg: TrainerConfig, topo: Topology, rank: int, groups, device: torch.device,
                 sharded: bool):
        """``groups``: the rank's process groups (``dp``, ``pp``): the verdict sums over one, then the
        other (``integrity.verdict``)."""
        self.topo, self.rank, self.device = topo, rank, device
        self.levels = [(groups.dp, topo.dp), (groups.pp, topo.pp)]
        self.sharded = sharded
        self.judge = AnomalyJudge(cfg.integrity, fp16=cfg.train.precision == "fp16")

    def agree(self, losses: list[torch.Tensor], loss_mult: float, grads, replica: int, scale: float | None,
              stats: CommStats, changed: bool = False) -> tuple[Verdict, float]:
        """The step's verdict over the world, and the seconds it took. ``grads``: what this rank's
        norm sums (its owned slices under a sharded optimizer: the world's sum is the model's;
        else its stage's: its replica's slot sums the stages); ``scale``: fp16's loss scale, by
        which the gradients still are multiplied."""
        timer = start_timer(self.device)
        sq = local_sq(grads, self.device)
        slots = 1 if self.sharded else self.topo.dp
        v = agree(losses, loss_mult, sq, 0 if self.sharded else replica, slots, self.rank, self.topo.world_size,
                  self.levels, self.device, sq_div=(scale * scale) if scale else 1.0, changed=changed)
        dt = timer.stop().seconds()
        if self.topo.world_size > 1:
            # Its time is the step's communication; its few bytes are not gradient traffic, which
            # comm_bytes counts (and compression_ratio divides).
            stats.add("all_reduce", 0, dt)
        return v, dt

    @staticmethod
    def clip(grads, v: Verdict, max_norm: float) -> None:
        """Scale ``grads`` so the norm of the whole model's (the replica's, where replicas step
        apart) is at most ``max_norm``."""
        total = v.replica_sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))

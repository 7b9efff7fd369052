"""A step's verdict, agreed over every rank of the plan in one small all-reduce.

Each rank adds what it alone knows into one float32 vector: the sum and count of its
micro-batch losses (the last stage's ranks), the sum of squares of its gradients in its
replica's slot (a sharded optimizer's rank: its own slice, in the one slot), and a flag in its
own slot where its loss (1) or its gradients (2) are not finite. A SUM over the world then
gives every rank the same step loss, gradient norms and flags, so every rank judges the step
alike with no further message: a non-finite or spiking step is dropped everywhere or nowhere.

The SUM runs in two levels, over the rank's data-parallel group, then over its pipeline (each
rank is in one of each, so the two sums are the world's): a ring's steps grow with its ranks,
and rings of dp and pp ranks take 2(dp - 1) + 2(pp - 1) steps against 2(dp * pp - 1) for the
world's. A group of one rank is skipped. The pipeline level is the collective clipping ran
before (the norm over the stages), and the whole reduction is also fp16's overflow check,
which took a collective of its own. Where neither was on, the data-parallel level is a round
trip the step did not make before (measured in docs/integrity.md).

Torch only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

LOSS, GRADS = 1.0, 2.0   # a rank's flag: its own loss not finite, else its gradients
CHANGED = 4.0            # its optimizer slice changed at rest since its last check (state_fingerprint)


@dataclass
class Verdict:
    loss: float | None          # the step's mean micro-batch loss over every replica (None: no loss seen)
    grad_norm: float            # the global gradient norm (local-step and server modes: the largest replica's)
    replica_sq: torch.Tensor    # this rank's replica's (or the whole model's) squared norm, on the device
    flags: list[float]          # per rank: 0, or LOSS / GRADS where its own values were not finite

    @property
    def finite(self) -> bool:
        return not any(self.flags)

    @property
    def loss_finite(self) -> bool:
        return not any(f == LOSS for f in self.flags)

    @property
    def changed_at_rest(self) -> bool:
        return any(f == CHANGED for f in self.flags)

    def flagged(self) -> list[int]:
        """The ranks where the trouble showed first: state changed at rest, else a non-finite loss,
        else a non-finite gradient."""
        worst = CHANGED if self.changed_at_rest else LOSS if not self.loss_finite else GRADS
        return [r for r, f in enumerate(self.flags) if f == worst]


def local_sq(grads, device: torch.device) -> torch.Tensor:
    """The sum of squares of ``grads`` in float32, on the device (as clipping always summed it)."""
    sq = torch.zeros((), device=device, dtype=torch.float32)
    for g in grads:
        sq += g.detach().float().pow(2).sum()
    return sq


def agree(losses: list[torch.Tensor], loss_div: float, sq: torch.Tensor, slot: int, slots: int, rank: int,
          world: int, groups, device: torch.device, sq_div: float = 1.0, changed: bool = False) -> Verdict:
    """The verdict of a step (every rank of the plan's world must call it). ``groups``: the
    ``(group, size)`` levels whose sums make the world's (a rank's data-parallel group and its
    pipeline; or the world itself, or None for the default group), each summed in turn.

    ``losses``: this rank's micro-batch losses (empty off the last stage), each to be divided by
    ``loss_div`` (fp16's scale folded into them); ``sq``: its squared gradient norm, added into
    ``slot`` of ``slots``; ``sq_div``: what the squared norms are divided by (fp16: the scale's square);
    ``changed``: this rank's own state changed while nothing wrote it (its flag says so, above any other)."""
    vec = torch.zeros(2 + slots + world, device=device, dtype=torch.float32)
    if losses:
        total = torch.stack([l.detach().float() for l in losses]).sum() / loss_div
        vec[0] = total
        vec[1] = float(len(losses))
    vec[2 + slot] = sq
    own = torch.where(torch.isfinite(vec[0]), torch.where(torch.isfinite(sq), 0.0, GRADS), LOSS)
    vec[2 + slots + rank] = CHANGED if changed else own
    if world > 1:
        for group, size in (groups if isinstance(groups, list) else [(groups, world)]):
            if size > 1:
                dist.all_reduce(vec, group=group)
    host = vec.tolist()   # the step's one wait for the device: the verdict is decided on the host
    n = host[1]
    loss = host[0] / n if n else None
    sqs = [x / sq_div for x in host[2:2 + slots]]
    norm = (math.nan if any(math.isnan(x) for x in sqs) else
            math.sqrt(max(sqs)) if all(math.isfinite(x) for x in sqs) else math.inf)
    flags = host[2 + slots:]
    # A flag summed with NaN from elsewhere is NaN: the rank's own slot is only ever written by it.
    flags = [f if math.isfinite(f) else GRADS for f in flags]
    return Verdict(loss, norm, vec[2 + slot] / sq_div, flags)

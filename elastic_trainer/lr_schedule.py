"""The learning rate as a pure function of the step (``train.lr_schedule``).

Nothing about the rate lives in optimizer state or in a scheduler object, so a
restore at any step and any dp x pp resumes it exactly: every rank (and every
parameter-server shard) sets the rate of step ``s`` from ``lr_at(train, s)``
just before that step's update.
"""

from __future__ import annotations

import math

from .config import TrainSection


def lr_at(train: TrainSection, step: int) -> float:
    """The rate of ``step`` (counted from 1): linear warm-up over ``warmup_steps`` to ``lr``
    (``lr * step / warmup_steps``), then constant, or a cosine / linear decay from ``lr``
    toward ``min_lr``, which it reaches just after the last step (step ``steps`` still moves)."""
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    w = train.warmup_steps
    if step <= w:
        return train.lr * step / w
    if train.lr_schedule == "constant":
        return train.lr
    # Fraction of the decay done before this step's update: 0 at the first step after warm-up.
    progress = min(1.0, (step - 1 - w) / max(1, train.steps - w))
    if train.lr_schedule == "cosine":
        return train.min_lr + (train.lr - train.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return train.lr - (train.lr - train.min_lr) * progress


def set_lr(optimizer, lr: float) -> None:
    """Give every parameter group of ``optimizer`` the rate ``lr``, times the group's ``lr_ratio``
    where it has one (a group with an lr of its own: ``optim.build``)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_ratio"] if "lr_ratio" in group else lr

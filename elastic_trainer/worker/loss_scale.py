"""Dynamic loss scaling for ``train.precision: fp16``, as torch's ``GradScaler`` does it, across ranks.

fp16's range ends at 65504 and its smallest normal is 6e-5: small gradients
vanish in backward unless the loss is scaled up first. The scale starts at
``train.loss_scale_init``; a step whose gradients hold an inf or a NaN on any
rank is skipped on every rank (one all-reduce of a flag over the whole world,
so no rank applies an update another drops) and the scale halves; after
``growth_interval`` good steps in a row it doubles. Gradients are unscaled
(multiplied by ``1 / scale``, exact: scales are powers of two) before
clipping and the optimizer, so both see true gradients. The scale and the
count of good steps ride in snapshots and durable checkpoints, so a restore
at any dp x pp continues with the same scale.
"""

from __future__ import annotations

import torch

GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5


class LossScaler:
    def __init__(self, init_scale: float, growth_interval: int):
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.growth_tracker = 0  # good steps in a row since the scale last changed

    def unscale_(self, grads: list[torch.Tensor]) -> None:
        inv = torch.tensor(self.scale, dtype=torch.float64).reciprocal().float().item()
        for g in grads:
            g.mul_(inv)

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= BACKOFF_FACTOR
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= GROWTH_FACTOR
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"loss_scale": self.scale, "loss_scale_growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict) -> None:
        """Take the scale from a snapshot's ``extra``; one from a run without scaling leaves it as it is."""
        if "loss_scale" in state:
            self.scale = float(state["loss_scale"])
            self.growth_tracker = int(state["loss_scale_growth_tracker"])

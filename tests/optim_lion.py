"""A user optimizer for tests, named by import path (``tests.optim_lion:Lion``): Lion (Chen et al.
2023, "Symbolic Discovery of Optimization Algorithms"), which torch.optim does not have."""

import torch


class Lion(torch.optim.Optimizer):
    """Lion: the sign of an interpolation of momentum and gradient, with decoupled weight decay.

    Elementwise (``elementwise = True``), so a run may shard its state; one float of state per
    element (``state_floats``), for the planner."""

    elementwise = True
    state_floats = 1

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr <= 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Lion: lr({lr}) must be > 0 and betas({betas}) in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)

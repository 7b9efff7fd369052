"""Tied parameters across pipeline stages: two copies whose gradients are summed every step.

A tie (a Hugging Face model's input embedding and LM head, ``models.hf``) is
one tensor in a single process. Cut into pipeline stages it is two parameters,
one in the first stage and one in the last, equal at the start. Summing their
gradients after the data-parallel average gives each copy the gradient the
single tensor would have had, so AdamW moves both alike and they stay equal.
The sum is local where one rank holds both; across ranks it is one exchange
between the two stages of a replica (the only ranks that hold the tensor),
over the replica's pipeline group, as Megatron's embedding group does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.timing import start_timer
from ..parallel.topology import Topology


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


class TiedGrads:
    """Sums the gradients of each ``(leader, follower)`` pair of global parameter names."""

    def __init__(self, ties: list[tuple[str, str]], named: dict[str, torch.nn.Parameter],
                 stage_bounds: list[tuple[int, int]], topo: Topology, replica: int, group):
        self.pairs = []  # (param here, peer global rank or None, this side leads)
        self.followers = {f for _, f in ties}
        for leader, follower in ties:
            a, b = named.get(leader), named.get(follower)
            if a is not None and b is not None:
                self.pairs.append(((a, b), None, True))
            elif a is not None or b is not None:
                other = follower if a is not None else leader
                block = int(other.split(".")[1])
                stage = next(s for s, (lo, hi) in enumerate(stage_bounds) if lo <= block < hi)
                self.pairs.append(((a if a is not None else b,), topo.rank(replica, stage % topo.pp), a is not None))
        self.group = group

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def sync(self, stats) -> float:
        """Make each pair's gradients their sum; the seconds spent exchanging."""
        spent = 0.0
        for params, peer, leads in self.pairs:
            if peer is None:
                a, b = params
                total = _grad(a) + _grad(b)
                a.grad.copy_(total)
                b.grad.copy_(total)
                continue
            g = _grad(params[0])
            timer = start_timer(g.device)
            buf = torch.empty_like(g)
            # The leader receives first and the follower sends first, so the pair never deadlocks.
            if leads:
                dist.recv(buf, src=peer, group=self.group)
                g.add_(buf)
                dist.send(g, dst=peer, group=self.group)
            else:
                dist.send(g, dst=peer, group=self.group)
                dist.recv(g, src=peer, group=self.group)
            dt = timer.stop().seconds()
            stats.add("tied_grads", g.numel() * g.element_size(), dt)
            spent += dt
        return spent

"""The optimizer on the 1/dp of a stage's parameters a rank owns (ZeRO-1/2), and the all-gather after it.

Each gradient bucket is split over the stage's DP group (``parallel.shard_ranges``).
The rank's optimizer (AdamW, or any elementwise one: ``optim.choice``) runs over views
into the parameters it owns, so its state
cover 1/dp of the stage and no second copy of the weights is kept; the update
writes through the views into the live parameters. The averaged gradients of
the owned shard (``GradSync.shard_grads``) become those views' ``.grad``.
After the update each bucket's owned shard is all-gathered, so every replica
holds the whole stage again.

An elementwise update is the same for every element, so running it on slices
gives the update a whole-tensor step gives, element by element. Parameter groups
are by the parameter's name, which its slice keeps.

State comes and goes by parameter name and element range (``ranges``:
name -> ``[start, end, shape]`` of the flattened parameter), so a snapshot
taken under one sharding loads under any other (``checkpoint.state``).
"""

from __future__ import annotations

import numpy as np
import torch

from ..checkpoint.optim_state import state_tensors
from ..comm.grad_sync import GradSync
from ..comm.shard_exchange import ShardExchange
from ..comm.stats import CommStats
from ..config import TrainSection
from ..parallel.shard_ranges import owned, owned_slices, shard_len


class _Owned:
    """One parameter's owned slice: where it lies in the parameter and in its bucket's shard."""

    __slots__ = ("name", "param", "start", "end", "bucket", "at", "view")

    def __init__(self, name: str, param: torch.nn.Parameter, start: int, end: int, bucket: int, at: int):
        if not param.is_contiguous():
            raise ValueError(f"{name}: a sharded optimizer needs contiguous parameters")
        self.name, self.param, self.start, self.end, self.bucket, self.at = name, param, start, end, bucket, at
        self.view = param.detach().view(-1)[start:end]


class ShardedOptimizer:
    """The optimizer of one rank of a sharded stage (see the module docstring)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], sync: GradSync, exchange: ShardExchange,
                 group_rank: int, train: TrainSection, build_optimizer, skip_in_norm: set[str] = frozenset()):
        """``named``: the rank's parameters by global name; ``sync``: its gradient sync, sharded over
        ``exchange``'s group, in which this rank is ``group_rank``; ``build_optimizer(named, train)``
        makes the optimizer (an elementwise one: see ``optim.choice``) over ``(name, slice)`` pairs; ``skip_in_norm``: names whose gradient the clip norm leaves out (the second
        copy of a tied parameter)."""
        self.sync, self.exchange, self.p = sync, exchange, exchange.p
        self.owned: list[_Owned] = []
        for b in sync.buckets:
            lo, hi = owned(b.numel, self.p, group_rank)
            for i, start, end, at in owned_slices([p.numel() for p in b.params], lo, hi):
                self.owned.append(_Owned(b.names[i], b.params[i], start, end, b.index, at))
        self._by_bucket: dict[int, list[_Owned]] = {}
        for o in self.owned:
            self._by_bucket.setdefault(o.bucket, []).append(o)
        self.optimizer = build_optimizer([(o.name, o.view) for o in self.owned], train)
        self._in_norm = [o for o in self.owned if o.name not in skip_in_norm]
        # Parameters in no bucket (frozen: no gradient, never updated) are the same on every
        # replica; group rank 0's snapshot holds them whole.
        bucketed = {id(p) for b in sync.buckets for p in b.params}
        self.unbucketed = [(n, p) for n, p in named if id(p) not in bucketed] if group_rank == 0 else []

    # -- the step -------------------------------------------------------------
    def attach_grads(self) -> list[torch.Tensor]:
        """Give each owned view its slice of the averaged shard as ``.grad``; returns them."""
        grads = []
        for o in self.owned:
            o.view.grad = self.sync.shard_grads[o.bucket][o.at:o.at + o.end - o.start]
            grads.append(o.view.grad)
        return grads

    def norm_sq(self) -> torch.Tensor:
        """Sum of squares of the owned gradients (tied second copies left out): summed over the
        world, the whole model's."""
        sq = torch.zeros((), dtype=torch.float32, device=self.owned[0].view.device if self.owned else "cpu")
        for g in self.norm_grads():
            sq += g.detach().float().pow(2).sum()
        return sq

    def norm_grads(self) -> list[torch.Tensor]:
        """The owned gradients the norm sums (tied second copies left out)."""
        return [o.view.grad for o in self._in_norm]

    def gather(self, stats: CommStats) -> None:
        """All-gather every bucket's updated shards into the live parameters."""
        with torch.no_grad():
            for b in self.sync.buckets:
                c = shard_len(b.numel, self.p)
                device = b.params[0].device
                mine = torch.zeros(c, dtype=torch.float32, device=device)
                for o in self._by_bucket.get(b.index, []):
                    mine[o.at:o.at + o.end - o.start] = o.view
                whole = torch.empty(c * self.p, dtype=torch.float32, device=device)
                self.exchange.all_gather(mine, whole, stats)
                for p, (offset, _) in zip(b.params, b.shapes):
                    p.view(-1).copy_(whole[offset:offset + p.numel()])

    # -- state by name and range ----------------------------------------------
    def named_views(self) -> list[tuple[str, torch.Tensor]]:
        """(name, owned slice of the parameter) pairs, and the whole parameters no bucket holds
        (group rank 0's): what a snapshot of this rank holds."""
        return [(o.name, o.view) for o in self.owned] + self.unbucketed

    def ranges(self) -> dict[str, list]:
        """name -> ``[start, end, shape]``: the flat range of the parameter each view holds."""
        return {o.name: [o.start, o.end, list(o.param.shape)] for o in self.owned}

    @property
    def state_nbytes(self) -> int:
        """Bytes of optimizer state tensors this rank holds."""
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values()
                   for v in st.values() if torch.is_tensor(v))

    def owned_ranges(self) -> dict[str, tuple[int, int]]:
        """name -> ``(start, end)``: the elements of the flattened parameter whose moments this rank owns."""
        return {o.name: (o.start, o.end) for o in self.owned}

    def load_state(self, optim: dict) -> None:
        """Set the owned moments from ``{name: {kind: flat array of the owned range, or number}}``
        (``merge_shards(..., owned=self.owned_ranges())``); a name without state starts fresh."""
        groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        for o in self.owned:
            st = optim.get(o.name)
            if not st:
                self.optimizer.state.pop(o.view, None)
                continue
            # reshape keeps an Assembled array's kind: it is loaded without one more copy
            flat = {k: (v if np.ndim(v) == 0 else v.reshape(-1)) for k, v in st.items()}
            self.optimizer.state[o.view] = state_tensors(self.optimizer, groups.get(id(o.view), {}), o.view, flat)

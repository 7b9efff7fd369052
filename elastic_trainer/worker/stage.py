"""One rank's share of training: its pipeline stage(s) of one replica, its optimizer, its data.

Torch only (no Ray), so it runs under any launcher and in tests with plain
processes. Parameter names are global (``blocks.<index>.<name>``) so a state
taken under one layout loads under another.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ..checkpoint.state import block_of, export_shard, load_into, merge_shards
from ..comm.allreduce import CommStats, GradAverager
from ..config import TrainerConfig, TrainSection
from ..data.dataset import TokenDataset, ensure_prepared
from ..data.sampler import GlobalSampler
from ..models.factory import build_blocks
from ..parallel.partition import stage_indices_for_rank
from ..parallel.topology import Topology
from .process_group import Groups

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def build_optimizer(params, train: TrainSection) -> torch.optim.Optimizer:
    """AdamW with torch's defaults for anything the config leaves unset."""
    kwargs = {"lr": train.lr, "weight_decay": train.weight_decay}
    if train.betas is not None:
        kwargs["betas"] = train.betas
    if train.eps is not None:
        kwargs["eps"] = train.eps
    return torch.optim.AdamW(params, **kwargs)


@dataclass
class StepResult:
    step: int
    loss: float | None  # mean micro-batch loss; only ranks holding the last stage know it
    compute_s: float
    comm_s: float
    comm_bytes: int
    samples: int
    cursor: int  # global index of the step's first sample


class StageTrainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        topo: Topology,
        rank: int,
        groups: Groups,
        stage_bounds: list[tuple[int, int]],
        device: torch.device,
    ):
        self.cfg, self.topo, self.rank, self.groups, self.device = cfg, topo, rank, groups, device
        self.replica, self.pp_rank = topo.coords(rank)
        p = cfg.parallel
        virtual = p.virtual_stages if p.schedule == "interleaved" else 1
        self.num_stages = topo.pp * virtual
        if len(stage_bounds) != self.num_stages:
            raise ValueError(f"{len(stage_bounds)} stage bounds given for {self.num_stages} pipeline stages")
        self.stage_ids = stage_indices_for_rank(self.pp_rank, topo.pp, virtual)
        self.stage_bounds = {s: stage_bounds[s] for s in self.stage_ids}

        # Every rank builds the whole model from the run's seed and keeps its
        # blocks, so initial weights match a single-process run exactly.
        blocks, self.loss_fn = build_blocks(cfg.model, cfg.train.seed)
        self.modules = {
            s: nn.Sequential(*blocks[a:b]).to(device) for s, (a, b) in self.stage_bounds.items()
        }
        del blocks
        self.params = [p for m in self.modules.values() for p in m.parameters()]
        self.optimizer = build_optimizer(self.params, cfg.train)
        self.averager = GradAverager(self.params, groups.dp, topo.dp, cfg.comm.bucket_mb)

        self.has_first = 0 in self.stage_ids
        self.has_last = self.num_stages - 1 in self.stage_ids
        self.dataset = None
        if self.has_first or self.has_last:
            ensure_prepared(cfg.data)
            self.dataset = TokenDataset.open(cfg.data)
        n_rows = len(self.dataset) if self.dataset is not None else 1
        self.sampler = GlobalSampler(n_rows, cfg.train.seed, cfg.data.shuffle)
        self.schedule = self._build_schedule() if topo.pp > 1 else None

    def _build_schedule(self):
        stages = [
            PipelineStage(self.modules[s], s, self.num_stages, self.device, group=self.groups.pp)
            for s in self.stage_ids
        ]
        n_micro = self.cfg.micro_batches
        if self.cfg.parallel.schedule == "interleaved":
            return ScheduleInterleaved1F1B(stages, n_micro, loss_fn=self.loss_fn)
        return _SCHEDULES[self.cfg.parallel.schedule](stages[0], n_micro, loss_fn=self.loss_fn)

    # -- naming -------------------------------------------------------------
    def named_parameters(self):
        """(global name, parameter) pairs: ``blocks.<global block index>.<name in block>``."""
        for s, (a, _) in self.stage_bounds.items():
            for name, p in self.modules[s].named_parameters():
                idx, _, rest = name.partition(".")
                yield f"blocks.{a + int(idx)}.{rest}", p

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().cpu().clone() for name, p in self.named_parameters()}

    @property
    def blocks(self) -> list[int]:
        return [i for a, b in self.stage_bounds.values() for i in range(a, b)]

    def export(self, step: int) -> dict:
        """A copy of this rank's state after ``step`` (parameters, AdamW state)."""
        return export_shard(step, self.named_parameters(), self.optimizer, self.blocks)

    def load(self, shards: list[dict]) -> int:
        """Load this rank's blocks from shards of one step; returns that step."""
        names = [n for n, _ in self.named_parameters()]
        step, params, optim = merge_shards(shards, names)
        load_into(self.named_parameters(), self.optimizer, params, optim)
        return step

    # -- one step -------------------------------------------------------------
    def _batch(self, step: int):
        train = self.cfg.train
        cursor = (step - 1) * train.global_batch_size
        if self.dataset is None:
            return None, None
        rows = self.sampler.replica_rows(cursor, train.global_batch_size, self.topo.dp, self.replica)
        x, y = self.dataset.sample(rows)
        return torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)

    def train_step(self, step: int) -> StepResult:
        """Forward and backward over the micro-batches, average grads over DP, clip, apply.

        ``step`` counts from 1; step s reads global samples [(s-1)*B, s*B).
        """
        x, y = self._batch(step)
        stats = CommStats()
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if self.schedule is None:
            n_micro = self.cfg.micro_batches
            for xm, ym in zip(x.chunk(n_micro), y.chunk(n_micro)):
                loss = self.loss_fn(self.modules[0](xm), ym)
                (loss / n_micro).backward()
                losses.append(loss.detach())
        else:
            self.schedule.step(
                *([x] if self.has_first else []),
                target=y if self.has_last else None,
                losses=losses if self.has_last else None,
                return_outputs=False,
            )
        self.averager.average(stats)
        if self.cfg.train.grad_clip is not None:
            self._clip(self.cfg.train.grad_clip, stats)
        self.optimizer.step()
        compute_s = time.perf_counter() - t0 - stats.seconds
        loss = float(torch.stack([l.detach() for l in losses]).mean()) if self.has_last and losses else None
        gb = self.cfg.train.global_batch_size
        return StepResult(step, loss, compute_s, stats.seconds, stats.bytes, gb // self.topo.dp, (step - 1) * gb)

    def _clip(self, max_norm: float, stats: CommStats) -> None:
        """Clip by the norm over the whole model: after DP averaging every replica holds
        the same grads, so summing squares over the PP group gives the global norm."""
        grads = [p.grad for p in self.params if p.grad is not None]
        sq = torch.zeros((), device=self.device, dtype=torch.float32)
        for g in grads:
            sq += g.detach().float().pow(2).sum()
        if self.topo.pp > 1:
            t0 = time.perf_counter()
            dist.all_reduce(sq, group=self.groups.pp)
            stats.add("all_reduce", sq.element_size(), time.perf_counter() - t0)
        total = sq.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))

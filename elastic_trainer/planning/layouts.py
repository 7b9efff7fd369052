"""Which ``dp x pp`` layouts, with which stage cut, a run could take on the workers there are.

Feasible means: the global batch divides into ``dp`` replicas of whole
micro-batches (so it stays the same whatever the layout), the model has a
block for every pipeline stage, and the schedule can run the micro-batches
(interleaving needs ``pp >= 2`` and a whole number of rounds). Whether a
layout fits the workers' memory, and how fast it runs, is the planner's
question.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TrainerConfig
from ..errors import ConfigError
from ..parallel.partition import blocks_for_rank, partition_blocks, stage_indices_for_rank


class NothingFits(ConfigError):
    """No layout is feasible on these workers (or fits their memory); the message says what was given."""


@dataclass(frozen=True)
class Layout:
    """``dp`` replicas of a ``pp``-rank pipeline, cut into ``stage_bounds`` (``[start, end)`` blocks per stage)."""

    dp: int
    pp: int
    stage_bounds: tuple[tuple[int, int], ...]
    micro_batches: int  # per replica and step
    stages_per_rank: int = 1  # virtual stages of the interleaved schedule

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    def stages_of(self, pp_rank: int) -> list[int]:
        """Pipeline stages PP rank ``pp_rank`` holds."""
        return stage_indices_for_rank(pp_rank, self.pp, self.stages_per_rank)

    def blocks_of(self, pp_rank: int) -> list[int]:
        """Blocks PP rank ``pp_rank`` holds, over all its stages."""
        return blocks_for_rank(self.stage_bounds, pp_rank, self.pp, self.stages_per_rank)


def feasible_layouts(cfg: TrainerConfig, param_counts: list[int], n_workers: int) -> list[Layout]:
    """Every feasible ``dp x pp`` on at most ``n_workers`` workers, by ``pp`` then ``dp``.

    The stage cut balances parameters (:func:`parallel.partition.partition_blocks`),
    the same cut for every ``dp`` of one ``pp``.
    """
    t, p = cfg.train, cfg.parallel
    virtual = p.stages_per_rank
    out = []
    for pp in range(1, n_workers + 1):
        n_stages = pp * virtual
        if n_stages > len(param_counts):
            break
        if p.schedule == "interleaved" and pp < 2:
            continue
        bounds = tuple(partition_blocks(param_counts, n_stages))
        for dp in range(1, n_workers // pp + 1):
            if t.global_batch_size % (dp * t.micro_batch_size):
                continue
            m = t.global_batch_size // (dp * t.micro_batch_size)
            # torch's 1F1B needs a micro-batch in flight per stage.
            if p.schedule == "1f1b" and pp > 1 and m < pp:
                continue
            # torch's interleaved schedule runs max(1, m // pp) rounds of equal size.
            if p.schedule == "interleaved" and m % max(1, m // pp):
                continue
            out.append(Layout(dp, pp, bounds, m, virtual))
    return out


def no_layout_message(cfg: TrainerConfig, n_workers: int) -> str:
    """Why :func:`feasible_layouts` found nothing, naming what was given and what would fit."""
    return (f"no dp x pp fits {n_workers} worker(s): global_batch_size({cfg.train.global_batch_size}) must divide "
            f"by dp * micro_batch_size({cfg.train.micro_batch_size}) for some dp <= {n_workers}"
            + (", and 'interleaved' needs pp >= 2" if cfg.parallel.schedule == "interleaved" else ""))

"""Which dp x pp to run on the workers there are: after a loss, and when nodes join.

Policies return decisions; they never touch Ray, so tests call them directly.

The estimate is deliberately simple (an analytic model, like nanoGPT's
``estimate_mfu``): per-step compute of a replica is its share of the global
batch times the heaviest stage's share of the parameters, stretched by the
pipeline bubble ``(m + pp - 1) / m``; gradient all-reduce moves
``2 (dp - 1) / dp`` of the heaviest stage's gradient bytes. Only ratios matter.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TrainerConfig
from ..parallel.partition import partition_blocks

# Bytes per parameter held by a worker: fp32 weight, grad, two AdamW moments,
# plus one snapshot copy.
_BYTES_PER_PARAM = 4 * 5
# Relative cost of moving one gradient byte vs one parameter-sample of compute;
# loopback-scale numbers, refined by the communication cost model later.
_COMM_WEIGHT = 0.02


@dataclass(frozen=True)
class PlanChoice:
    dp: int
    pp: int
    stage_bounds: tuple[tuple[int, int], ...]
    est_step_cost: float
    reason: str

    @property
    def world_size(self) -> int:
        return self.dp * self.pp


def candidate_plans(cfg: TrainerConfig, param_counts: list[int], n_workers: int,
                    worker_memory_bytes: float | None) -> list[PlanChoice]:
    """Every valid dp x pp on at most ``n_workers`` workers, cheapest estimated step first."""
    t, p = cfg.train, cfg.parallel
    virtual = p.stages_per_rank
    total = sum(param_counts) or 1
    out = []
    for pp in range(1, n_workers + 1):
        n_stages = pp * virtual
        if n_stages > len(param_counts):
            break
        if p.schedule == "interleaved" and pp < 2:
            continue
        bounds = tuple(partition_blocks(param_counts, n_stages))
        stage_params = [sum(param_counts[a:b]) for a, b in bounds]
        # With interleaving a rank holds `virtual` stages.
        rank_params = max(sum(stage_params[s::pp]) for s in range(pp))
        if worker_memory_bytes is not None and rank_params * _BYTES_PER_PARAM > worker_memory_bytes:
            continue
        for dp in range(1, n_workers // pp + 1):
            if t.global_batch_size % (dp * t.micro_batch_size):
                continue
            m = t.global_batch_size // (dp * t.micro_batch_size)
            if p.schedule == "interleaved" and m % max(1, m // pp):
                continue
            compute = (t.global_batch_size / dp) * (rank_params / total) * (m + pp - 1) / m
            comm = _COMM_WEIGHT * 2 * (dp - 1) / dp * rank_params * 4 / total * t.global_batch_size
            out.append(PlanChoice(dp, pp, bounds, compute + comm,
                                  f"estimated step cost {compute + comm:.3f} (compute {compute:.3f}, comm {comm:.3f})"))
    # Cheapest first; on a tie prefer more replicas (a live copy of every stage
    # survives the next loss), then fewer workers.
    return sorted(out, key=lambda c: (round(c.est_step_cost, 9), -c.dp, c.world_size))


def choose_plan(cfg: TrainerConfig, param_counts: list[int], n_workers: int,
                worker_memory_bytes: float | None = None) -> PlanChoice | None:
    """The plan with the highest expected throughput that fits, or None if nothing fits."""
    plans = candidate_plans(cfg, param_counts, n_workers, worker_memory_bytes)
    return plans[0] if plans else None

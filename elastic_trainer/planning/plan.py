"""What a run will look like: topology and stage cut. Ray-free, so `elastic-trainer plan` and tests use it directly."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import TrainerConfig
from ..errors import ConfigError
from ..parallel.partition import blocks_for_rank, partition_blocks
from ..parallel.topology import Topology
from ..models.factory import block_param_counts


@dataclass
class Plan:
    topology: Topology
    stage_bounds: list[tuple[int, int]]  # [start, end) blocks of each pipeline stage
    stage_params: list[int]
    stages_per_rank: int = 1             # virtual stages of the interleaved schedule
    rank_nodes: dict[int, str] = field(default_factory=dict)  # rank -> node id, once placed
    shard_optimizer: str = "none"        # parallel.shard_optimizer it runs with, set at its set-up

    def blocks_of(self, rank: int) -> list[int]:
        """Blocks ``rank`` holds: those of every pipeline stage of its PP rank."""
        _, pp_rank = self.topology.coords(rank)
        return blocks_for_rank(self.stage_bounds, pp_rank, self.topology.pp, self.stages_per_rank)

    def describe(self) -> dict:
        return {
            "dp": self.topology.dp,
            "pp": self.topology.pp,
            "world_size": self.topology.world_size,
            "stages": [
                {"stage": i, "blocks": list(b), "params": n}
                for i, (b, n) in enumerate(zip(self.stage_bounds, self.stage_params))
            ],
            "rank_nodes": dict(self.rank_nodes),
            "shard_optimizer": self.shard_optimizer,
        }


def plan_for(cfg: TrainerConfig, dp: int, pp: int, stage_bounds, counts: list[int]) -> Plan:
    """A ``Plan`` of ``dp x pp`` with the given stage cut, for the model whose blocks have ``counts`` parameters."""
    bounds = [tuple(b) for b in stage_bounds]
    return Plan(Topology(dp, pp), bounds, [sum(counts[a:b]) for a, b in bounds], cfg.parallel.stages_per_rank)


def make_plan(cfg: TrainerConfig, counts: list[int] | None = None) -> Plan:
    """Cut the model into the configured number of pipeline stages, balancing parameters.
    ``counts``: the parameters per block where the caller has counted them already."""
    # Parameter counts only: measuring activations runs the model on the meta device, whose first
    # op imports torch._dynamo (1.2 s). The driver measures it for the built-in models and the
    # controller for the rest, while its workers start (model_shape.ShapeInBackground).
    if counts is None:
        counts = block_param_counts(cfg.model)
    p = cfg.parallel
    if len(counts) < p.num_stages:
        raise ConfigError(
            f"the model has {len(counts)} blocks, fewer than pp({p.pp}) x stages per rank = {p.num_stages} stages"
        )
    return plan_for(cfg, p.dp, p.pp, partition_blocks(counts, p.num_stages), counts)

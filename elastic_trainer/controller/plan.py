"""What a run will look like: topology and stage cut. Ray-free, so `elastic-trainer plan` and tests use it directly."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import TrainerConfig
from ..models.factory import block_param_counts
from ..parallel.partition import partition_blocks
from ..parallel.topology import Topology
from ..errors import ConfigError


@dataclass
class Plan:
    topology: Topology
    stage_bounds: list[tuple[int, int]]  # [start, end) blocks of each pipeline stage
    stage_params: list[int]
    rank_nodes: dict[int, str] = field(default_factory=dict)  # rank -> node id, once placed

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
        }


def make_plan(cfg: TrainerConfig) -> Plan:
    """Cut the model into the configured number of pipeline stages, balancing parameters."""
    counts = block_param_counts(cfg.model)
    p = cfg.parallel
    num_stages = p.pp * (p.virtual_stages if p.schedule == "interleaved" else 1)
    if len(counts) < num_stages:
        raise ConfigError(
            f"the model has {len(counts)} blocks, fewer than pp({p.pp}) x stages per rank = {num_stages} stages"
        )
    bounds = partition_blocks(counts, num_stages)
    return Plan(Topology(p.dp, p.pp), bounds, [sum(counts[a:b]) for a, b in bounds])

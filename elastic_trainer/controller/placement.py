"""Where each rank runs: a placement group plus a rank -> bundle assignment.

Placement policy (``scaling``):
- ``workers_per_node``: CPU workers default to one per node (the cluster's
  nodes are the unit that fails); GPU workers default to packing nodes, one
  worker per GPU. An explicit value k reserves nodes in groups of k workers.
- ``replica_placement``: ``spread`` puts a replica's stages together on a node
  and different replicas of a stage on different nodes, so a node loss leaves
  live replicas of every stage; ``pack`` puts a stage's replicas on one node so
  gradient all-reduce stays on the node.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from ..config import ScalingSection
from ..errors import PlacementError
from ..parallel.topology import Topology


@dataclass
class Placement:
    pg: object
    rank_bundle: dict[int, int]
    rank_node: dict[int, str]
    strategy: str

    def remove(self) -> None:
        remove_placement_group(self.pg)


def _bundles(scaling: ScalingSection, n: int) -> tuple[list[dict], list[int], str]:
    """Bundles, the bundle of each worker slot, and the placement strategy."""
    res = {k: float(v) for k, v in scaling.resources_per_worker.items() if v}
    k = scaling.workers_per_node
    if k is None:
        strategy = "PACK" if scaling.uses_gpu else "STRICT_SPREAD"
        return [dict(res) for _ in range(n)], list(range(n)), strategy
    sizes = [min(k, n - i) for i in range(0, n, k)]
    bundles = [{r: v * s for r, v in res.items()} for s in sizes]
    slots = [b for b, s in enumerate(sizes) for _ in range(s)]
    return bundles, slots, "STRICT_SPREAD" if len(bundles) > 1 else "PACK"


def assign_ranks(topo: Topology, slot_nodes: list[str], policy: str) -> list[int]:
    """Slot index of each rank. Slots are grouped by node; the policy fixes the fill order."""
    order = sorted(range(len(slot_nodes)), key=lambda i: (slot_nodes[i], i))
    if policy == "spread":   # replica-major: a replica's stages share nodes, replicas spread
        pairs = [(r, s) for r in range(topo.dp) for s in range(topo.pp)]
    else:                    # stage-major: a stage's replicas share nodes
        pairs = [(r, s) for s in range(topo.pp) for r in range(topo.dp)]
    slot_of_rank = [0] * topo.world_size
    for slot, (r, s) in zip(order, pairs):
        slot_of_rank[topo.rank(r, s)] = slot
    return slot_of_rank


def place_workers(scaling: ScalingSection, topo: Topology, name: str) -> Placement:
    """Reserve resources for every rank or fail with what the cluster has, after ``placement_timeout_s``."""
    n = topo.world_size
    bundles, slots, strategy = _bundles(scaling, n)
    pg = placement_group(bundles, strategy=strategy, name=name)
    if not pg.wait(timeout_seconds=scaling.placement_timeout_s):
        remove_placement_group(pg)
        alive = [nd for nd in ray.nodes() if nd.get("Alive")]
        have = [{k: v for k, v in nd["Resources"].items() if k in ("CPU", "GPU", "memory")} for nd in alive]
        raise PlacementError(
            f"could not place {n} workers ({topo}) within placement_timeout_s({scaling.placement_timeout_s:g}): "
            f"asked for {len(bundles)} bundles {bundles[0]} with strategy {strategy}"
            f"{' (one worker per node)' if strategy == 'STRICT_SPREAD' and scaling.workers_per_node is None else ''}; "
            f"the cluster has {len(alive)} alive nodes with {have}. Add nodes, lower dp * pp, "
            f"or raise scaling.workers_per_node."
        )
    table = placement_group_table(pg)["bundles_to_node_id"]
    slot_nodes = [table[b] for b in slots]
    slot_of_rank = assign_ranks(topo, slot_nodes, scaling.replica_placement)
    return Placement(
        pg=pg,
        rank_bundle={r: slots[s] for r, s in enumerate(slot_of_rank)},
        rank_node={r: slot_nodes[s] for r, s in enumerate(slot_of_rank)},
        strategy=strategy,
    )

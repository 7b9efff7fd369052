"""Where workers run: nodes chosen by the controller, one actor pinned to each slot.

The controller picks nodes itself (and pins each worker with node affinity)
rather than reserving a placement group, because the same code must place the
first workers, replacements after a node loss, and new workers when nodes
join, next to workers that already exist.

Policy (``scaling``):
- ``workers_per_node``: CPU workers default to one per node (the node is the
  unit that fails); GPU workers default to as many as the node has GPUs.
- ``replica_placement``: ``spread`` puts a replica's stages together on a node
  and different replicas of a stage on different nodes, so a node loss leaves
  live replicas of every stage; ``pack`` puts a stage's replicas on one node so
  gradient all-reduce stays on the node.
"""

from __future__ import annotations

import math
import time

import ray

from ..config import ScalingSection
from ..errors import PlacementError
from ..parallel.topology import Topology


def _available_per_node() -> dict[str, dict[str, float]]:
    # Ray has no public per-node view of *available* resources.
    from ray._private.state import available_resources_per_node

    return available_resources_per_node()


def free_slots(scaling: ScalingSection, occupied: dict[str, int]) -> dict[str, int]:
    """How many more workers each alive node can take, given ``occupied`` (node -> our workers there)."""
    need = {k: float(v) for k, v in scaling.resources_per_worker.items() if v}
    avail = _available_per_node()
    out = {}
    for node in ray.nodes():
        nid = node["NodeID"]
        if not node.get("Alive") or nid not in avail:
            continue
        fit = min((math.floor(avail[nid].get(r, 0.0) / v + 1e-9) for r, v in need.items()), default=0)
        cap = scaling.workers_per_node if scaling.workers_per_node is not None else (
            fit if scaling.uses_gpu else 1)
        n = min(fit, cap - occupied.get(nid, 0))
        if n > 0:
            out[nid] = n
    return out


def find_nodes(scaling: ScalingSection, n: int, occupied: dict[str, int], timeout_s: float) -> list[str]:
    """A node for each of ``n`` new workers, waiting up to ``timeout_s`` for the cluster to fit them."""
    deadline = time.monotonic() + timeout_s
    while True:
        slots = free_slots(scaling, occupied)
        if sum(slots.values()) >= n:
            out = []
            # Fullest first, so GPU workers pack nodes; node id breaks ties deterministically.
            for nid in sorted(slots, key=lambda k: (-slots[k], k)):
                out += [nid] * min(slots[nid], n - len(out))
            return out
        if time.monotonic() >= deadline:
            alive = [nd for nd in ray.nodes() if nd.get("Alive")]
            have = [{k: v for k, v in nd["Resources"].items() if k in ("CPU", "GPU")} for nd in alive]
            per_node = (f"at most {scaling.workers_per_node} per node" if scaling.workers_per_node
                        else "one per GPU" if scaling.uses_gpu else "one worker per node")
            raise PlacementError(
                f"could not place {n} workers of {dict(scaling.resources_per_worker)} ({per_node}) within "
                f"{timeout_s:g}s: room for {sum(slots.values())} on the cluster's {len(alive)} alive nodes "
                f"with {have}. Add nodes, lower dp * pp, or raise scaling.workers_per_node."
            )
        time.sleep(0.2)


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

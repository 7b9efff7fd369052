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
  live replicas of every stage; where the cluster has too few nodes it packs
  workers onto those there are rather than wait (``fault_tolerance`` says what
  that costs). ``strict_spread`` waits for the nodes instead. ``pack`` puts a
  stage's replicas on one node so gradient all-reduce stays on the node.
"""

from __future__ import annotations

import logging
import math
import time

import ray

from ...config import ScalingSection
from ...errors import PlacementError
from ...parallel.topology import Topology

log = logging.getLogger(__name__)


def _available_per_node() -> dict[str, dict[str, float]]:
    # Ray has no public per-node view of *available* resources.
    from ray._private.state import available_resources_per_node

    return available_resources_per_node()


def _spread_cap(scaling: ScalingSection) -> int | None:
    """Workers per node that the placement prefers: None where only resources bound it."""
    if scaling.workers_per_node is not None:
        return scaling.workers_per_node
    return None if scaling.uses_gpu else 1


def dead_nodes() -> set[str]:
    """Nodes Ray has declared dead (its view lags a death, never a life: a node listed here is gone)."""
    return {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}


def free_slots(scaling: ScalingSection, occupied: dict[str, int], pack: bool = False) -> dict[str, int]:
    """How many more workers each alive node can take, given ``occupied`` (node -> our workers there).

    ``pack``: as many as the node's resources fit, past the one-per-node preference of CPU
    workers (an explicit ``workers_per_node`` always holds)."""
    need = {k: float(v) for k, v in scaling.resources_per_worker.items() if v}
    avail = _available_per_node()
    cap = _spread_cap(scaling)
    if pack and scaling.workers_per_node is None:
        cap = None
    out = {}
    leaving = draining_nodes()
    for node in ray.nodes():
        nid = node["NodeID"]
        if not node.get("Alive") or nid not in avail or nid in leaving:
            continue
        fit = min((math.floor(avail[nid].get(r, 0.0) / v + 1e-9) for r, v in need.items()), default=0)
        # Available resources lag a worker just started: bound by the node's total, less ours there.
        room = min((math.floor(node["Resources"].get(r, 0.0) / v + 1e-9) for r, v in need.items()), default=0)
        n = min(fit, (cap if cap is not None else room) - occupied.get(nid, 0))
        if n > 0:
            out[nid] = n
    return out


def draining_nodes() -> dict[str, float | None]:
    """The nodes Ray is draining (a preemption notice, an autoscaler's scale-down), each with its
    deadline (epoch seconds; None where none was given): one read of the GCS. A cluster that
    cannot say is taken as draining none."""
    try:
        from ray._private.state import state

        found = state.get_draining_nodes()
    except Exception as e:  # noqa: BLE001 - an older GCS, or one not reachable this moment
        log.debug("could not read the draining nodes: %s", e)
        return {}
    return {nid: (ms / 1000.0 if ms else None) for nid, ms in found.items()}


def may_pack(scaling: ScalingSection) -> bool:
    """Whether the run packs workers onto fewer nodes where the cluster has too few to spread."""
    return scaling.replica_placement != "strict_spread" and scaling.workers_per_node is None \
        and not scaling.uses_gpu


def _pick(slots: dict[str, int], n: int) -> list[str]:
    out = []
    # Fullest first, so GPU workers pack nodes; node id breaks ties deterministically.
    for nid in sorted(slots, key=lambda k: (-slots[k], k)):
        out += [nid] * min(slots[nid], n - len(out))
    return out


def pick_nodes(scaling: ScalingSection, n: int, occupied: dict[str, int]) -> list[str]:
    """A node for each of up to ``n`` new workers where the cluster has room now: spread (one
    per node for CPU workers) as far as the nodes allow, the rest packed where ``may_pack``."""
    slots = free_slots(scaling, occupied)
    out = _pick(slots, n)
    if len(out) < n and may_pack(scaling):
        packed = free_slots(scaling, occupied, pack=True)
        for nid in out:
            packed[nid] -= 1
        out += _pick({k: v for k, v in packed.items() if v > 0}, n - len(out))
    return out


def find_nodes(scaling: ScalingSection, n: int, occupied: dict[str, int], timeout_s: float) -> list[str]:
    """A node for each of ``n`` new workers, waiting up to ``timeout_s`` for the cluster to fit them.

    One worker per node (CPU workers) is the preference; where the cluster has fewer nodes
    the workers are packed onto those there are at once, unless ``replica_placement`` is
    ``strict_spread`` (then it waits for nodes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = pick_nodes(scaling, n, occupied)
        if len(out) == n:
            return out
        if time.monotonic() >= deadline:
            alive = [nd for nd in ray.nodes() if nd.get("Alive")]
            have = [{k: v for k, v in nd["Resources"].items() if k in ("CPU", "GPU")} for nd in alive]
            per_node = (f"at most {scaling.workers_per_node} per node" if scaling.workers_per_node
                        else "one per GPU" if scaling.uses_gpu
                        else "one worker per node (replica_placement strict_spread)"
                        if scaling.replica_placement == "strict_spread" else "packed as resources allow")
            room = sum(free_slots(scaling, occupied, pack=may_pack(scaling)).values())
            raise PlacementError(
                f"could not place {n} workers of {dict(scaling.resources_per_worker)} ({per_node}) within "
                f"{timeout_s:g}s: room for {room} on the cluster's {len(alive)} alive nodes "
                f"with {have}. Add nodes, lower dp * pp"
                + (", or use replica_placement spread to pack workers onto fewer nodes."
                   if scaling.replica_placement == "strict_spread" else ", or raise scaling.workers_per_node.")
            )
        time.sleep(0.2)


def fault_tolerance(topo: Topology, rank_nodes: dict[int, str], replicas: int) -> str:
    """One line on which node losses a placement survives live, and which need a snapshot or more."""
    nodes = set(rank_nodes.values())
    per_stage = [len({rank_nodes[topo.rank(r, s)] for r in range(topo.dp)}) for s in range(topo.pp)]
    weakest = min(per_stage)
    head = f"{topo.world_size} workers on {len(nodes)} node{'s' if len(nodes) != 1 else ''}"
    if len(nodes) == 1:
        return (f"{head}: losing that node loses every copy (live and snapshot); only a durable checkpoint "
                "(checkpoint.storage) survives it. Add nodes to survive node losses live.")
    if weakest >= 2:
        return (f"{head}: every stage has replicas on {weakest} or more nodes, so losing any {weakest - 1} "
                f"node{'s' if weakest > 2 else ''} is survived from live replicas")
    lost = [s for s, k in enumerate(per_stage) if k == 1]
    snap = min(replicas, len(nodes))
    return (f"{head}: stage{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} sit on one node each, so "
            f"losing such a node restores from the last snapshot (copies on {snap} nodes) and redoes the steps "
            "since; other losses are survived from live replicas")


def assign_ranks(topo: Topology, slot_nodes: list[str], policy: str) -> list[int]:
    """Slot index of each rank. Slots are grouped by node; the policy fixes the fill order."""
    order = sorted(range(len(slot_nodes)), key=lambda i: (slot_nodes[i], i))
    if policy in ("spread", "strict_spread"):   # replica-major: a replica's stages share nodes, replicas spread
        pairs = [(r, s) for r in range(topo.dp) for s in range(topo.pp)]
    else:                    # stage-major: a stage's replicas share nodes
        pairs = [(r, s) for s in range(topo.pp) for r in range(topo.dp)]
    slot_of_rank = [0] * topo.world_size
    for slot, (r, s) in zip(order, pairs):
        slot_of_rank[topo.rank(r, s)] = slot
    return slot_of_rank

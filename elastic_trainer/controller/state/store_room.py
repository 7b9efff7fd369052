"""Whether each node's object store holds the snapshots the start places there.

Snapshots live in Ray's object store: each rank's own parts (``snapshots_kept``
of its 1/dp share, and the next while it is put) and the copies other nodes
pin there (``replicas - 1`` of each part, spread over the nodes). Past
``object_store_memory`` Ray spills objects to disk, so a store too small for
them does not stop the run: it makes snapshots and restores as slow as the
disk. At the defaults (2 kept, 2 replicas, on a CPU) the snapshots hold 3.5
times the training state, which a default store (30% of the node's memory)
often cannot, so the start says so, with the figures, once.
"""

from __future__ import annotations

import logging

import ray

from ...config import TrainerConfig
from ...planning.plan import Plan
from ...planning.policy import rank_store_bytes

log = logging.getLogger(__name__)

_GIB = 1 << 30


def store_shortfalls(cfg: TrainerConfig, plan: Plan, rank_nodes: dict[int, str],
                     stores: dict[str, float]) -> list[dict]:
    """Nodes whose object store (``stores``: node -> bytes) is smaller than the snapshots the
    ranks on them (``rank_nodes``) put or are sent: node, store, need and ranks, largest need first."""
    topo = plan.topology
    per_stage = rank_store_bytes(cfg, topo.dp, topo.pp, plan.stage_bounds)
    need: dict[str, int] = {}
    ranks: dict[str, list[int]] = {}
    for r, node in rank_nodes.items():
        need[node] = need.get(node, 0) + per_stage[topo.coords(r)[1]]
        ranks.setdefault(node, []).append(r)
    out = [{"node": n, "store_bytes": int(stores[n]), "need_bytes": b, "ranks": sorted(ranks[n])}
           for n, b in need.items() if n in stores and b > stores[n]]
    return sorted(out, key=lambda s: -s["need_bytes"])


def warn_store_short(cfg: TrainerConfig, plan: Plan, rank_nodes: dict[int, str], run_name: str) -> list[dict]:
    """Log (and return) the nodes whose object store is short (:func:`store_shortfalls`)."""
    stores = {n["NodeID"]: (n.get("Resources") or {}).get("object_store_memory", 0.0)
              for n in ray.nodes() if n.get("Alive")}
    short = store_shortfalls(cfg, plan, rank_nodes, stores)
    if short:
        worst = short[0]
        ck = cfg.checkpoint
        log.warning("[%s] %d node(s) have an object store smaller than the snapshots placed there; node %s "
                    "holds %.2f GiB and its ranks %s need %.2f GiB (snapshots_kept=%d and the next in flight "
                    "of their parts, and %d other replica(s)' copies). Ray spills the rest to disk, which "
                    "slows snapshots and restores: give Ray more object_store_memory, or lower "
                    "checkpoint.snapshots_kept or checkpoint.replicas", run_name, len(short),
                    worst["node"][:12], worst["store_bytes"] / _GIB, worst["ranks"], worst["need_bytes"] / _GIB,
                    ck.snapshots_kept, ck.replicas - 1)
    return short

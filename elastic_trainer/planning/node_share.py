"""A worker's share of its node: how many workers a node fits, and the host memory a worker's
snapshot copy buffers may hold (``checkpoint.host_memory_gb``, see ``checkpoint.host_arena``)."""

from __future__ import annotations

import math

from ..config import TrainerConfig

# Unset checkpoint.host_memory_gb: half the node's memory. Page-locked memory cannot be swapped or
# reclaimed, and the rest of the host (the data loader, the page cache, Ray) needs the other half.
HOST_PIN_SHARE = 0.5


def workers_fit(resources: dict, cfg: TrainerConfig) -> int:
    """Workers of the run's ``resources_per_worker`` a node of ``resources`` (Ray's totals) holds,
    at most ``scaling.workers_per_node``; at least 1."""
    sc = cfg.scaling
    need = {k: float(v) for k, v in sc.resources_per_worker.items() if v}
    n = min((math.floor(resources.get(r, 0.0) / v + 1e-9) for r, v in need.items()), default=1)
    if sc.workers_per_node is not None:
        n = min(n, sc.workers_per_node)
    return max(1, n)


def snapshot_host_budget(resources: dict, cfg: TrainerConfig) -> int | None:
    """Bytes one worker's snapshot copy buffers may hold on a node of ``resources``; None where the
    node reports no memory and none is configured (no bound)."""
    gb = cfg.checkpoint.host_memory_gb
    node = gb * (1 << 30) if gb is not None else resources.get("memory", 0.0) * HOST_PIN_SHARE
    return int(node / workers_fit(resources, cfg)) if node > 0 else None

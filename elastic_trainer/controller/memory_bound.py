"""The memory a worker may use, where ``scaling.worker_memory_gb`` is not set: what the worker has.

A CPU worker's share of its node: the node's schedulable memory (Ray's
``memory`` resource, what Ray leaves beside its object store) times the
worker's share of the node's CPUs, at the smallest node a worker fits on. A
GPU worker: its device's memory, asked of one GPU before any worker is
placed (the host's snapshot copies are then counted apart, see
``planning.memory``). The bound found is written into the run's config, so
the start, every re-plan and growth are held to it, and logged.
"""

from __future__ import annotations

import logging

import ray

from ..config import TrainerConfig

log = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 60.0


def host_share_bytes(nodes: list[dict], cpus_per_worker: float) -> int | None:
    """The smallest per-worker share of memory over the alive ``nodes`` (``ray.nodes()`` entries)
    that have room for a worker of ``cpus_per_worker`` CPUs; None where no node has."""
    shares = []
    for n in nodes:
        res = n.get("Resources") or {}
        cpus, mem = res.get("CPU", 0.0), res.get("memory", 0.0)
        if n.get("Alive") and mem > 0 and cpus >= max(cpus_per_worker, 1e-9):
            per_node = max(1, int(cpus // cpus_per_worker)) if cpus_per_worker > 0 else 1
            shares.append(mem / per_node)
    return int(min(shares)) if shares else None


def _device_bytes() -> int:
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory)


def resolve_memory_bound(cfg: TrainerConfig, run_name: str) -> str | None:
    """Set ``cfg.scaling.worker_memory_gb`` to what a worker has where the user left it unset;
    returns what was set and why (None where nothing was)."""
    sc = cfg.scaling
    if sc.worker_memory_gb is not None:
        return None
    if sc.uses_gpu:
        try:
            probe = ray.remote(num_gpus=sc.resources_per_worker.get("GPU", 1), num_cpus=0)(_device_bytes)
            nbytes = ray.get(probe.remote(), timeout=_PROBE_TIMEOUT_S)
        except Exception as e:  # no GPU free in time, or a driver error: say so and go unbounded
            log.warning("[%s] no memory bound per worker: could not read a GPU's memory (%s); set "
                        "scaling.worker_memory_gb", run_name, e)
            return None
        why = "the memory of a GPU"
    else:
        nbytes = host_share_bytes(ray.nodes(), sc.resources_per_worker.get("CPU", 1.0))
        if nbytes is None:
            return None
        why = "a worker's share of the smallest node's memory"
    sc.worker_memory_gb = nbytes / (1 << 30)
    said = f"memory bound per worker {sc.worker_memory_gb:.2f} GiB: {why} (scaling.worker_memory_gb sets it)"
    log.info("[%s] %s", run_name, said)
    return said

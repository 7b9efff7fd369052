"""The memory a worker may use, where ``scaling.worker_memory_gb`` is not set: what the worker has.

A CPU worker's share of its node: the node's memory (Ray's ``memory`` and
``object_store_memory`` resources together: a worker's resident set holds
the snapshot parts it puts into the store, see ``planning.memory``) less
``HOST_HEADROOM`` (Ray's own processes, the driver and the controller; Ray's
memory monitor kills at 95% of the node) over the workers the node holds
(``scaling.workers_per_node``, else its CPUs over a worker's), at the
smallest node a worker fits on. A GPU worker: its device's
memory less ``GPU_HEADROOM`` (the CUDA context, NCCL's buffers and the
caching allocator's slack, which the model does not count), asked of one GPU
before any worker is placed (the host's snapshot copies are then counted
apart). The bound found is written into the run's config, so
the start, every re-plan and growth are held to it, and logged.
"""

from __future__ import annotations

import logging

import ray

from ...config import TrainerConfig

log = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 60.0
GPU_HEADROOM = 0.1
HOST_HEADROOM = 0.1


def host_share_bytes(nodes: list[dict], cpus_per_worker: float, workers_per_node: int | None = None) -> int | None:
    """The smallest per-worker share of memory over the alive ``nodes`` (``ray.nodes()`` entries)
    that have room for a worker of ``cpus_per_worker`` CPUs; None where no node has."""
    shares = []
    for n in nodes:
        res = n.get("Resources") or {}
        cpus, mem = res.get("CPU", 0.0), res.get("memory", 0.0) + res.get("object_store_memory", 0.0)
        if n.get("Alive") and mem > 0 and cpus >= max(cpus_per_worker, 1e-9):
            per_node = workers_per_node or (max(1, int(cpus // cpus_per_worker)) if cpus_per_worker > 0 else 1)
            shares.append(mem * (1 - HOST_HEADROOM) / per_node)
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
        ref = ray.remote(num_gpus=sc.resources_per_worker.get("GPU", 1), num_cpus=0)(_device_bytes).remote()
        try:
            nbytes = int(ray.get(ref, timeout=_PROBE_TIMEOUT_S) * (1 - GPU_HEADROOM))
        except Exception as e:  # no GPU free in time, or a driver error: say so and go unbounded
            ray.cancel(ref, force=True)   # not to take a GPU later
            log.warning("[%s] no memory bound per worker: could not read a GPU's memory (%s); set "
                        "scaling.worker_memory_gb", run_name, e)
            return None
        why = f"a GPU's memory less {GPU_HEADROOM:.0%} for CUDA's own"
    else:
        nbytes = host_share_bytes(ray.nodes(), sc.resources_per_worker.get("CPU", 1.0), sc.workers_per_node)
        if nbytes is None:
            return None
        why = "a worker's share of the smallest node's memory"
    sc.worker_memory_gb = nbytes / (1 << 30)
    said = f"memory bound per worker {sc.worker_memory_gb:.2f} GiB: {why} (scaling.worker_memory_gb sets it)"
    log.info("[%s] %s", run_name, said)
    return said

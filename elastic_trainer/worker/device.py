"""Which GPU a worker drives, set explicitly.

Ray assigns each GPU worker a GPU id. By default it also hides every other
GPU from the process (``CUDA_VISIBLE_DEVICES``), and NCCL between two
workers on one node then cannot use NVLink or P2P: it sees one device per
process. So workers start with every GPU of the node visible
(:data:`SHARE_GPUS_ENV`, as Ray Train shares its workers' GPUs), and each
binds its own with ``torch.cuda.set_device`` and passes it to its process
groups as ``device_id``. Nothing relies on ``cuda:0``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

# Set on GPU workers: Ray then leaves CUDA_VISIBLE_DEVICES as the node has it.
SHARE_GPUS_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def device_index(gpu_id: str | int, visible: str | None) -> int:
    """The CUDA index of the GPU Ray calls ``gpu_id`` in a process whose CUDA_VISIBLE_DEVICES is
    ``visible`` (None or empty: every GPU, so the id is the index)."""
    gpu_id = str(gpu_id).strip()
    if not visible:
        if not gpu_id.isdigit():
            raise ValueError(f"GPU id {gpu_id!r} is not an index, and CUDA_VISIBLE_DEVICES is not set to map it")
        return int(gpu_id)
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    if gpu_id not in listed:
        raise ValueError(f"GPU id {gpu_id!r} assigned by Ray is not in CUDA_VISIBLE_DEVICES={visible!r}")
    return listed.index(gpu_id)


def worker_device(gpu_ids: Sequence[str | int], visible: str | None, cuda_available: bool) -> torch.device:
    """The device of a worker Ray gave ``gpu_ids``: its first GPU, or the CPU when it has none."""
    if not gpu_ids or not cuda_available:
        return torch.device("cpu")
    return torch.device("cuda", device_index(gpu_ids[0], visible))


def bind(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (before anything touches CUDA)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def current_visible() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")

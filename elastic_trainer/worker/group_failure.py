"""What a rank does with its process groups when a peer fails, by backend.

gloo and NCCL fail differently, so they leave differently:

- **gloo** raises in a collective whose peer has gone (its sockets close), and
  ``destroy_process_group`` returns at once. Leaving is destroying.
- **NCCL** does not raise when a peer dies: its kernels wait for the peer on
  the GPU. ``destroy_process_group`` flushes pending work first, so with a dead
  peer it can hang for good. A survivor instead *aborts* its communicators
  (``ncclCommAbort`` through ``_abort_process_group``), which ends the pending
  kernels, and then joins the next plan in new groups. Where the backend can
  shrink a communicator (``torch.distributed.shrink_group``, NCCL 2.27 and
  later), the survivors drop the dead ranks in place instead and keep the world
  group for the next plan (no rendezvous), see :func:`shrink_world`.

The NCCL watchdog is set to report, not kill (:func:`watchdog_env`): the
survivors' processes hold the live copies of recent states, which is what
makes recovery take seconds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch.distributed as dist
# Aborting is not public API yet; it is what torchft and torch's own elastic tests use.
from torch.distributed import distributed_c10d as _c10d

log = logging.getLogger(__name__)

# Backend -> how a rank leaves its groups (in ``reset``, after a failure and on every re-plan).
LEAVE_ROUTINES = {"gloo": "destroy", "nccl": "abort"}


def _destroy() -> None:
    dist.destroy_process_group()


def _abort() -> None:
    _c10d._abort_process_group()


_ROUTINES: dict[str, Callable[[], None]] = {"destroy": _destroy, "abort": _abort}


def leave_routine(backend: str) -> str:
    """The routine (``destroy`` or ``abort``) a rank of ``backend`` leaves its groups with.
    A mixed backend (``cpu:gloo,cuda:nccl``) holds NCCL communicators, so it aborts."""
    names = [part.rpartition(":")[2] for part in backend.lower().split(",")]
    if "nccl" in names:
        return LEAVE_ROUTINES["nccl"]
    if all(n in LEAVE_ROUTINES for n in names):
        return LEAVE_ROUTINES[names[0]]
    raise ValueError(f"no way to leave groups of backend {backend!r}; known: {', '.join(LEAVE_ROUTINES)}")


def leave_groups(backend: str) -> None:
    """Leave every group of the default one (of ``backend``) with its backend's routine."""
    _ROUTINES[leave_routine(backend)]()


def abort_needed(backend: str) -> bool:
    """Whether ``backend``'s collectives can block on a dead peer without raising, so a failure
    must abort them from outside (the controller, or the worker's step guard)."""
    return leave_routine(backend) == "abort"


def watchdog_env(collective_timeout_s: float, environ: dict | None = None) -> dict[str, str]:
    """Set (where the run's ``scaling.env_vars`` did not) how ProcessGroupNCCL's watchdog reacts,
    before the group is made; returns what is in effect.

    - ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: on a timeout the watchdog reports; it neither kills
      the process (1, 3) nor aborts behind our back (2). The abort is ours, from the controller
      or the step guard, as ``_abort_process_group`` asks.
    - ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``: a dump on a timeout ends with the heartbeat monitor
      killing the process once it is written.
    - The heartbeat monitor stays on, for a watchdog that itself hangs (a wedged driver), with a
      timeout past anything the recovery path waits: twice the collective timeout plus a minute.
    """
    env = os.environ if environ is None else environ
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(int(2 * collective_timeout_s + 60)),
    }
    for key, value in wanted.items():
        if key in env and env[key] != value:
            log.info("keeping %s=%s from the environment (the recovery path expects %s)", key, env[key], value)
        env.setdefault(key, value)
    return {k: env[k] for k in wanted}


def can_shrink() -> bool:
    """Whether the default group can drop ranks in place: torch has ``shrink_group`` and the
    group's backend supports it (NCCL 2.27 and later, bound to a device)."""
    if not dist.is_initialized() or not hasattr(dist, "shrink_group"):
        return False
    pg = _c10d._get_default_group()
    device = getattr(pg, "bound_device_id", None)
    if device is None:
        return False
    try:
        return bool(pg._get_backend(device).supports_shrinking)
    except (RuntimeError, AttributeError):
        return False


def shrink_world(excluded: list[int]) -> tuple[int, int]:
    """Drop the ``excluded`` ranks from the default group, aborting the work they left pending;
    every survivor calls it at once. The subgroups go (their ranks no longer hold); the world
    stays for the next plan. Returns (this rank's new rank, new world size)."""
    dist.shrink_group(sorted(excluded), shrink_flags=_c10d.SHRINK_ABORT)
    return dist.get_rank(), dist.get_world_size()

"""torch.distributed set-up for one rank: the world group plus its DP and PP subgroups."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
# Public API has no way to change a group's timeout after it is built.
from torch.distributed.distributed_c10d import _set_pg_timeout

from ..parallel.topology import Topology


@dataclass
class Groups:
    """The subgroups one rank belongs to."""

    dp: object  # ranks holding the same stage in other replicas
    pp: object  # ranks holding the other stages of the same replica


def free_port(host: str = "") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_groups(
    backend: str, master_addr: str, master_port: int, topo: Topology, rank: int, timeout_s: float,
    rendezvous_timeout_s: float | None = None,
) -> Groups:
    """Join the world group and build every DP and PP subgroup.

    ``timeout_s`` bounds every collective; ``rendezvous_timeout_s`` bounds the
    wait for the other ranks to arrive, so a set-up with a dead member fails
    fast instead of holding this rank for a whole collective timeout.
    Each rank creates just the two subgroups it belongs to
    (``use_local_synchronization``): a group's members agree on it among
    themselves.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    # Joining waits for the other ranks (rendezvous timeout); after that every
    # collective gets the (possibly tightened) collective timeout.
    join = timedelta(seconds=rendezvous_timeout_s or timeout_s)
    store = dist.TCPStore(master_addr, master_port, topo.world_size, is_master=rank == 0,
                          timeout=join, wait_for_workers=True)
    dist.init_process_group(backend, store=store, world_size=topo.world_size, rank=rank, timeout=join)
    replica, stage = topo.coords(rank)
    # Only a group's members meet to build it; the others do not wait on it.
    dp = dist.new_group(topo.dp_group_ranks(stage), timeout=join, use_local_synchronization=True)
    pp = dist.new_group(topo.pp_group_ranks(replica), timeout=join, use_local_synchronization=True)
    collective = timedelta(seconds=timeout_s)
    for group in (None, dp, pp):
        _set_pg_timeout(collective, group)
    return Groups(dp=dp, pp=pp)


def destroy_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

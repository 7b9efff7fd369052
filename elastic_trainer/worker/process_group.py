"""torch.distributed set-up for one rank: the world group plus its DP and PP subgroups."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
# Public API has no way to change a group's timeout after it is built, nor to
# reset the default group's name counter after a failed join (see destroy_groups).
from torch.distributed import distributed_c10d as _c10d
from torch.distributed.distributed_c10d import _set_pg_timeout

from ..parallel.topology import Topology
from .group_carry import Detached, attach
from .group_failure import leave_groups, watchdog_env


@dataclass
class Groups:
    """The subgroups one rank belongs to."""

    dp: object  # ranks holding the same stage in other replicas
    pp: object  # ranks holding the other stages of the same replica
    world: object = None  # the plan's whole world, by handle (a collective on it fails once it is gone)


class SetupAborted(RuntimeError):
    """The controller gave up on the plan this rank was joining."""


def free_port(host: str = "") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_groups(
    backend: str, master_addr: str, master_port: int, topo: Topology, rank: int, timeout_s: float,
    rendezvous_timeout_s: float | None = None, aborted: Callable[[], bool] | None = None,
    device: torch.device | None = None, carried: dict[str, Detached] | None = None,
    sockets: dict | None = None, timings: dict | None = None,
) -> Groups:
    """Join the world group and build every DP and PP subgroup.

    ``timeout_s`` bounds every collective; ``rendezvous_timeout_s`` bounds the
    wait for the other ranks to arrive, so a set-up with a dead member fails
    fast instead of holding this rank for a whole collective timeout.
    Each rank creates just the two subgroups it belongs to
    (``use_local_synchronization``): a group's members agree on it among
    themselves. ``aborted`` is polled while waiting for the other ranks: when
    it turns true (the controller abandoned this plan) the join ends at once
    with :class:`SetupAborted` instead of holding this rank until the timeout.
    ``device``: this rank's CUDA device, bound to the groups (``device_id``) so NCCL
    creates its communicators at once and splits the subgroups off the world's.
    ``carried``: role (``dp``, ``pp``) -> a group of the last plan with the same members in
    the same order (``group_carry``), put into the new world instead of built. ``sockets``:
    role (``world``, ``dp``, ``pp``) -> a ``GroupSockets`` that takes the sockets opened while
    that group is built. ``timings``: filled with the seconds each part took (``meet``: the
    store and every rank's arrival; ``world``; ``dp``, ``pp``: building; ``check``: the
    carried groups' check).
    """
    destroy_groups()
    if backend == "nccl":
        watchdog_env(timeout_s)
    # Joining waits for the other ranks (rendezvous timeout); after that every
    # collective gets the (possibly tightened) collective timeout.
    join = timedelta(seconds=rendezvous_timeout_s or timeout_s)
    global _STORE
    timings = {} if timings is None else timings
    t0 = time.perf_counter()
    with _taking(sockets, "world"):
        store = _meet(master_addr, master_port, topo.world_size, rank, join, aborted or (lambda: False))
        _STORE = store
        t1 = time.perf_counter()
        bound = device if backend == "nccl" and device is not None and device.type == "cuda" else None
        dist.init_process_group(backend, store=store, world_size=topo.world_size, rank=rank, timeout=join,
                                device_id=bound)
    timings.update(meet=t1 - t0, world=time.perf_counter() - t1)
    return subgroups(topo, rank, join, timedelta(seconds=timeout_s), carried, sockets, timings)


def subgroups(topo: Topology, rank: int, join: timedelta, collective: timedelta,
              carried: dict[str, Detached] | None = None, sockets: dict | None = None,
              timings: dict | None = None) -> Groups:
    """Build this rank's DP and PP subgroups of the default group (or put back those
    ``carried``), then give every group the collective timeout (``join`` bounds the building)."""
    replica, stage = topo.coords(rank)
    members = {"dp": topo.dp_group_ranks(stage), "pp": topo.pp_group_ranks(replica)}
    carried = carried or {}
    timings = {} if timings is None else timings
    made = {}
    # Every rank builds in one order, and checks carried groups only after: a group's members
    # all reach its building without waiting on another group first.
    for role in ("dp", "pp"):
        if role not in carried:
            t = time.perf_counter()
            # Only a group's members meet to build it; the others do not wait on it.
            with _taking(sockets, role):
                made[role] = dist.new_group(members[role], timeout=join, use_local_synchronization=True)
            timings[role] = time.perf_counter() - t
    t = time.perf_counter()
    for role, d in carried.items():
        made[role] = attach(d, members[role])
        _check_carried(made[role], role, rank, join)
    timings["check"] = time.perf_counter() - t
    world = _c10d._get_default_group()
    for group in (None, made["dp"], made["pp"]):
        _set_pg_timeout(collective, group)
    return Groups(dp=made["dp"], pp=made["pp"], world=world)


def _taking(sockets: dict | None, role: str):
    return sockets[role].opened_during() if sockets else nullcontext()


def _check_carried(group, role: str, rank: int, join: timedelta) -> None:
    """One small all-reduce on a carried group, bounded by ``join``: every member must have
    carried it too (else this times out or counts short) before a step relies on it."""
    _set_pg_timeout(join, group)
    ones = torch.ones(1)
    dist.all_reduce(ones, group=group)
    if int(ones.item()) != group.size():
        raise RuntimeError(f"rank {rank}: the {role} group carried from the last plan answered for "
                           f"{int(ones.item())} of its {group.size()} members")


def _meet(addr: str, port: int, world: int, rank: int, join: timedelta, aborted: Callable[[], bool]):
    """Open the plan's store and wait until every rank has reached it.

    The waits are short polls rather than one blocking call, because a
    blocked call cannot be interrupted: a member that died would hold every
    other rank here for the whole rendezvous timeout.
    """
    deadline = time.monotonic() + join.total_seconds()

    def check(what: str) -> None:
        if aborted():
            raise SetupAborted(f"rank {rank} stopped {what}: the controller abandoned this plan")
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} timed out after {join.total_seconds():g}s {what} "
                               f"(store {addr}:{port}, world size {world}; failure.rendezvous_timeout_s)")

    if rank != 0:
        # The master's port accepts once rank 0 has opened the store.
        while True:
            check("waiting for rank 0's store")
            try:
                socket.create_connection((addr, port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.02)
    listen = {"master_listen_fd": _listener(addr, port, world)} if rank == 0 else {}
    store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=join, wait_for_workers=False, **listen)
    store.add("arrived", 1)
    while store.add("arrived", 0) < world:
        check(f"waiting for {world} ranks to arrive")
        time.sleep(0.01)
    return store


def _listener(addr: str, port: int, world: int) -> int:
    """A socket listening on ``addr:port`` in ``addr``'s own family, for the store to serve on.

    Left to itself the store listens on every interface, IPv6 first, so an IPv4
    peer arrives as ``::ffff:a.b.c.d``; torch looks each peer's address up
    (getnameinfo, for its logs), and that form is in no hosts file, so every
    lookup goes to DNS. A burst of them went unanswered and each stalled the
    store's one serving thread for the resolver's 5 s timeout: every
    rendezvous of 32 ranks here took 5.1 s (48 ranks: 10 s), of 24 ranks
    0.1 s. Listening on the address the ranks dial, in its family, the peers
    arrive as they are. The store closes the socket when it goes."""
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        s.listen(max(128, 2 * world))
    except BaseException:
        s.close()
        raise
    return s.detach()


# The plan's store, held as long as its world: a shrink opens new connections to it, and rank
# 0's server lives only while its object does.
_STORE = None


def destroy_groups() -> None:
    """Leave every group (the backend's own way, see ``group_failure``), and forget any join
    that failed half-way.

    The default group is named after a process-wide counter that
    ``init_process_group`` bumps before it meets the other ranks, and only a
    successful ``destroy_process_group`` resets. A rank whose join timed out
    (a member died at the rendezvous) would otherwise join the next plan under
    another name than its peers, wait for keys nobody writes, and fail again.
    """
    global _STORE
    _STORE = None
    if dist.is_initialized():
        leave_groups(dist.get_backend())
    elif dist.get_pg_count():
        _c10d._world.group_count = 0

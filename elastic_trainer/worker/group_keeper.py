"""One worker's process groups across plans: joining, leaving by backend, and a failure's abort or shrink.

The training thread joins and leaves (``setup``, ``reset``); the controller's
``abort_comms`` reaches the control thread while the training thread may be
blocked inside a collective, and the step guard's thread may abort on a
timeout. A lock keeps those changes one at a time. See ``group_failure`` for
what each backend needs, and ``group_sockets`` for ending a gloo collective
whose peer went silent.

On gloo a group whose members are the same, in the same order, in the next
plan is carried into it (``group_carry``) rather than built again. Each group
is known by its key: its role and its members' worker ids in group order (the
controller names them). After a failed step the groups stay as they are until
the controller says which to keep (``settle``): the others' sockets are cut
then, which also ends any collective a peer still waits in on them.
"""

from __future__ import annotations

import logging
import threading
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from ..parallel.topology import Topology
from .group_carry import Detached, detach, sequence
from .group_failure import abort_needed, can_shrink, leave_groups, shrink_world
from .group_sockets import GroupSockets
from .process_group import Groups, destroy_groups, init_groups, subgroups
from .step_guard import StepGuard

log = logging.getLogger(__name__)

ROLES = ("dp", "pp")


class GroupKeeper:
    def __init__(self, name: str):
        self.name = name                     # for logs: "[run] worker N"
        self.backend: str | None = None
        self.timeout_s = 300.0               # the collective timeout of the current plan
        self._groups: Groups | None = None
        self._shrunk: tuple[int, int, int] | None = None  # (shrink id, rank, world size) held for the next plan
        self._guard: StepGuard | None = None
        # The sockets each group opened when built (``world``, ``dp``, ``pp``), cut when a peer
        # goes silent or the group is let go after a failure.
        self._sockets = {role: GroupSockets() for role in ("world", *ROLES)}
        self._keys: dict[str, tuple] = {}    # role -> key of the group held, while it is intact
        self._carried: dict[str, tuple[tuple, Detached, GroupSockets]] = {}  # out of the registry, for the next plan
        self._pgs: dict[str, object] = {}    # role -> this plan's group (outlives a failed step's reset)
        self.join_timings: dict[str, float] = {}   # the last join's parts (``init_groups``), seconds
        self._lock = threading.RLock()

    def join(self, backend: str, addr: str, port: int, topo: Topology, rank: int, timeout_s: float,
             rendezvous_timeout_s: float | None, aborted, device: torch.device,
             reuse_world: int | None = None, keys: dict[str, tuple] | None = None) -> tuple[Groups, str, list[str]]:
        """Join a plan's groups: in the world a shrink kept (``reuse_world``, when it matches this
        rank and size), else by rendezvous, carrying the groups ``leave`` kept whose ``keys``
        match. Returns the groups, which way (``shrunk`` or ``rendezvous``), and the roles
        carried."""
        self.timeout_s = timeout_s
        self.join_timings = {}
        keys = {role: tuple(k) for role, k in (keys or {}).items()}
        with self._lock:
            kept = self._shrunk
            self._shrunk = None
            carried = {role: d for role, (key, d, _) in self._carried.items() if keys.get(role) == key}
            if len(carried) < len(self._carried):
                self._drop_carried([r for r in self._carried if r not in carried])
            if kept is not None and reuse_world == kept[0] and kept[1:] == (rank, topo.world_size):
                join = timedelta(seconds=rendezvous_timeout_s or timeout_s)
                groups = subgroups(topo, rank, join, timedelta(seconds=timeout_s), timings=self.join_timings)
                how = "shrunk"
            else:
                if reuse_world is not None:
                    log.warning("%s: the plan keeps shrunk world %s as rank %d of %d, this worker holds %s: "
                                "joining by rendezvous", self.name, reuse_world, rank, topo.world_size, kept)
                fresh = {"world": GroupSockets(), **{r: GroupSockets() for r in ROLES if r not in carried}}
                try:
                    groups = init_groups(backend, addr, port, topo, rank, timeout_s, rendezvous_timeout_s,
                                         aborted=aborted, device=device, carried=carried, sockets=fresh,
                                         timings=self.join_timings)
                finally:
                    # Even a failed join's sockets are its groups' (to cut), and a carried group
                    # that was not put back is let go with the rest.
                    self._sockets.update(fresh)
                    for role in carried:
                        self._sockets[role] = self._carried[role][2]
                    self._carried = {}
                how = "rendezvous"
            self.backend, self._groups = backend, groups
            self._pgs = {"dp": groups.dp, "pp": groups.pp}
            self._keys = keys if how == "rendezvous" else {}
        return groups, how, sorted(carried)

    def hold(self) -> None:
        """A step failed (gloo): let the stage go but leave the groups as they are, connected,
        for the controller to settle (``settle``, then the next plan's ``leave``)."""
        with self._lock:
            self._groups = None

    def leave(self, keep: dict[str, tuple] | None = None) -> None:
        """Leave every group, except a world a shrink kept for the next plan, and (gloo) the
        groups of ``keep`` (role -> key) this rank holds intact, which the next ``join``
        carries."""
        with self._lock:
            self._groups = None
            if self._shrunk is not None:
                return
            if keep and dist.is_initialized() and self.backend == "gloo":
                for role, key in keep.items():
                    key = tuple(key)
                    pg = self._group(role)
                    if self._keys.get(role) == key and role not in self._carried and pg is not None:
                        self._carried[role] = (key, detach(pg), self._sockets[role])
                        self._sockets[role] = GroupSockets()
            self._keys, self._pgs = {}, {}
            destroy_groups()
            for s in self._sockets.values():
                s.forget()
            self._drop_carried([r for r in self._carried if not keep or r not in keep])

    def _group(self, role: str):
        """This plan's group of ``role``, while it is still in torch's registry."""
        pg = self._pgs.get(role)
        return pg if pg is not None and pg in _c10d._world.pg_map else None

    def _drop_carried(self, roles) -> None:
        for role in roles:
            key, d, sockets = self._carried.pop(role)
            sockets.cut()   # gloo closes them only once the last reference goes
            log.info("%s: let the %s group %s go", self.name, role, list(key))

    def addresses(self) -> list[list]:
        """[host, port] of this process's end of every connection its groups hold
        (``GroupSockets.addresses``): how a peer's "connection closed" error names it."""
        with self._lock:
            return sorted({a for s in self._sockets.values() for a in s.addresses()})

    def state(self, busy: bool) -> dict:
        """What the controller settles a failure on: each intact group's key and the operations
        issued on it, and whether a step is still running here (``busy``)."""
        with self._lock:
            held = {}
            if self.backend == "gloo" and dist.is_initialized():
                for role, key in self._keys.items():
                    pg = self._group(role)
                    if pg is not None:
                        held[role] = [list(key), sequence(pg)]
            return {"busy": busy, "held": held}

    def role_of(self, pg) -> str | None:
        """The role (``dp``, ``pp``) of this plan's group ``pg``; None for any other group."""
        return next((role for role, g in self._pgs.items() if g is pg and pg is not None), None)

    def settle(self, keep: list[str]) -> int:
        """After a failure: keep the groups of roles ``keep`` as they are, cut every other
        group's sockets (the world's too), so whatever waits in them ends now. Returns the
        sockets cut."""
        with self._lock:
            cut = 0
            for role, s in self._sockets.items():
                if role not in keep:
                    cut += s.cut()
            self._keys = {role: k for role, k in self._keys.items() if role in keep}
            return cut

    def fail(self, excluded: list[int], shrink_id: int | None, timeout_s: float = 30.0) -> dict:
        """A peer failed (the controller says so): end whatever this rank's collectives wait for.
        gloo's fail on their own where the peer's process is gone; the controller asks here
        only where a peer went silent, and the groups' sockets are cut (``group_sockets``).
        NCCL's are shrunk past the ``excluded`` ranks where the backend can (keeping the world),
        else aborted. Either way the step in flight, if any, then raises (``StepGuard.trip``)
        rather than go on with what the aborted work left."""
        with self._lock:
            if self.backend is None or not dist.is_initialized():
                return {"shrunk": False, "aborted": False}
            if not abort_needed(self.backend):
                self._keys = {}
                return {"shrunk": False, "aborted": False,
                        "sockets_cut": sum(s.cut() for s in self._sockets.values())}
            try:
                if excluded and shrink_id is not None and can_shrink():
                    out = self._shrink(excluded, shrink_id, timeout_s)
                    if out is not None:
                        return out
                if dist.is_initialized():
                    leave_groups(self.backend)
                return {"shrunk": False, "aborted": True}
            finally:
                if self._guard is not None:
                    self._guard.trip("the controller ended its collectives after a peer failed")

    def _shrink(self, excluded: list[int], shrink_id: int, timeout_s: float) -> dict | None:
        """Shrink the world past ``excluded``: the subgroups, where the step's kernels wait, are
        aborted first; the shrink itself runs on a thread bounded by ``timeout_s`` (a survivor
        that aborted instead would hold the others in it for good). None: it failed, the caller
        aborts."""
        for group in (self._groups.dp, self._groups.pp) if self._groups else ():
            try:
                _c10d._abort_process_group(group)
            except (ValueError, RuntimeError):
                pass  # already gone
        box: dict = {}

        def run() -> None:
            try:
                box["result"] = shrink_world(excluded)
            except BaseException as e:  # noqa: BLE001 - reported by the caller
                box["error"] = e

        t = threading.Thread(target=run, name="shrink", daemon=True)
        t.start()
        t.join(timeout_s)
        if "result" in box:
            rank, size = box["result"]
            self._shrunk = (shrink_id, rank, size)
            log.info("%s: shrank the world past ranks %s: now rank %d of %d", self.name, excluded, rank, size)
            return {"shrunk": True, "rank": rank, "world_size": size}
        why = f"{type(box['error']).__name__}: {box['error']}" if "error" in box else f"not done in {timeout_s:g} s"
        log.warning("%s: shrinking past ranks %s failed (%s); aborting instead", self.name, excluded, why)
        if dist.is_initialized():
            _c10d._abort_process_group()   # also ends a shrink still waiting
        t.join(1.0)
        return None

    def guarded(self, what: str, timeout_s: float | None = None):
        """A context that bounds ``what`` by ``timeout_s`` (the controller's step timeout; default
        the collective timeout) where the backend needs it (``step_guard``); gloo's own timeouts
        raise, so there it is a no-op."""
        if self.backend is None or not abort_needed(self.backend):
            return nullcontext()
        if self._guard is None:
            self._guard = StepGuard(self._expire)
        return self._guard.watch(what, max(timeout_s or 0.0, self.timeout_s))

    def _expire(self, what: str) -> None:
        with self._lock:
            if self._shrunk is not None:
                return   # the controller already ended the step; the world is kept for the next plan
            log.warning("%s: %s outlived its timeout: aborting its groups", self.name, what)
            if dist.is_initialized():
                leave_groups(self.backend)

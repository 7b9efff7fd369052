"""One worker's process groups across plans: joining, leaving by backend, and a failure's abort or shrink.

The training thread joins and leaves (``setup``, ``reset``); the controller's
``abort_comms`` reaches the control thread while the training thread may be
blocked inside a collective, and the step guard's thread may abort on a
timeout. A lock keeps those changes one at a time. See ``group_failure`` for
what each backend needs, and ``group_sockets`` for ending a gloo collective
whose peer went silent.
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
from .group_failure import abort_needed, can_shrink, leave_groups, shrink_world
from .group_sockets import GroupSockets
from .process_group import Groups, destroy_groups, init_groups, subgroups
from .step_guard import StepGuard

log = logging.getLogger(__name__)


class GroupKeeper:
    def __init__(self, name: str):
        self.name = name                     # for logs: "[run] worker N"
        self.backend: str | None = None
        self.timeout_s = 300.0               # the collective timeout of the current plan
        self._groups: Groups | None = None
        self._shrunk: tuple[int, int, int] | None = None  # (shrink id, rank, world size) held for the next plan
        self._guard: StepGuard | None = None
        self._sockets = GroupSockets()       # a gloo plan's sockets, cut when a peer goes silent
        self._lock = threading.RLock()

    def join(self, backend: str, addr: str, port: int, topo: Topology, rank: int, timeout_s: float,
             rendezvous_timeout_s: float | None, aborted, device: torch.device,
             reuse_world: int | None = None) -> tuple[Groups, str]:
        """Join a plan's groups: in the world a shrink kept (``reuse_world``, when it matches this
        rank and size), else by rendezvous. Returns the groups and which way (``shrunk`` or
        ``rendezvous``)."""
        self.timeout_s = timeout_s
        with self._lock:
            kept = self._shrunk
            self._shrunk = None
            if kept is not None and reuse_world == kept[0] and kept[1:] == (rank, topo.world_size):
                join = timedelta(seconds=rendezvous_timeout_s or timeout_s)
                groups, how = subgroups(topo, rank, join, timedelta(seconds=timeout_s)), "shrunk"
            else:
                if reuse_world is not None:
                    log.warning("%s: the plan keeps shrunk world %s as rank %d of %d, this worker holds %s: "
                                "joining by rendezvous", self.name, reuse_world, rank, topo.world_size, kept)
                with self._sockets.opened_during():
                    groups = init_groups(backend, addr, port, topo, rank, timeout_s, rendezvous_timeout_s,
                                         aborted=aborted, device=device)
                how = "rendezvous"
            self.backend, self._groups = backend, groups
        return groups, how

    def leave(self) -> None:
        """Leave every group, except a world a shrink kept for the next plan."""
        with self._lock:
            self._groups = None
            if self._shrunk is None:
                destroy_groups()
                self._sockets.forget()

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
                return {"shrunk": False, "aborted": False, "sockets_cut": self._sockets.cut()}
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

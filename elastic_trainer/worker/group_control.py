"""The actor's side of its process groups after a failure: ending what its collectives wait
for, saying where its step is blocked, and keeping or cutting groups as the controller settles
them (``controller.group_settle``).

A mixin of ``TrainWorker``: it needs ``groups``, ``gpu``, ``_busy`` and ``_step_thread``.
"""

from __future__ import annotations

import ray

from .device import bind
from .wait_site import waiting_in, where


class GroupControl:
    @ray.method(concurrency_group="control")
    def abort_comms(self, excluded: list[int], shrink_id: int | None = None, timeout_s: float = 30.0) -> dict:
        """A peer failed: end what this rank's collectives wait for, at once (``GroupKeeper.fail``):
        nothing on gloo; on NCCL, shrink the world past the ``excluded`` ranks where the backend
        can (within ``timeout_s``), else abort. The training thread's step then fails and its
        ``reset`` follows."""
        bind(self.gpu)
        return self.groups.fail(excluded, shrink_id, timeout_s)

    @ray.method(concurrency_group="control")
    def group_state(self) -> dict:
        """Each intact group's key and operation count, whether a step runs here, and the role of
        the group it is blocked in, if at a wait ``wait_site`` knows (what the controller settles
        a failure on, ``GroupKeeper.state``)."""
        busy = self._busy > 0
        state = self.groups.state(busy=busy)
        if busy:
            state["waiting"] = waiting_in(self._step_thread, self.groups.role_of)
            if state["waiting"] is None:
                state["at"] = where(self._step_thread)   # for the recovery event, where a wait runs out
        return state

    @ray.method(concurrency_group="control")
    def settle_groups(self, keep: list[str]) -> int:
        """After a failure: keep the groups of roles ``keep``, cut the others' sockets (which ends
        what waits in them); the sockets cut."""
        return self.groups.settle(keep)

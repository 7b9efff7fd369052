"""Workers fenced out of the plan for silence: kept alive, and let back in as spares when they answer.

A rank that answers no heartbeat for ``failure.heartbeat_timeout_s`` is lost to
the step, and the run re-plans without it. It was SIGKILLed as well; on a real
cluster that kills healthy workers for a long GC pause, a host under memory
pressure or a slow link. Now it is fenced: out of the pool, so no plan, group,
snapshot or checkpoint of the run includes it, and its groups are cut by the
survivors (``group_settle``), so whatever it was waiting in fails when it wakes.
One ping is left waiting on it. When that ping answers, the worker is reset
(its old groups and stage dropped), and only once the reset has ended is it
taken back as a spare, where the grow check may re-plan onto it: a reset
still running beside the next set-up would tear down the groups that set-up
just joined. One that dies is forgotten, once its node is asked
whether memory killed it (a worker stalled in its host's memory reclaim goes
silent before the kernel kills it: ``memory_kills``). One still silent after
``failure.fence_timeout_s`` is killed then.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import ray

from ..run.fault_points import NO_POINTS
from .memory_kills import MemoryKills
from ..run.workers import WorkerHandle, WorkerPool, kill_actor

log = logging.getLogger(__name__)


@dataclass
class Fenced:
    handle: WorkerHandle
    since: float     # time.monotonic() when it was fenced
    ask: object      # the question left waiting on it: a ping, then its group state, then its reset
    answered: bool = False
    resetting: bool = False      # its reset was sent; it is let back in when that ends
    rank: int | None = None      # the rank it held when it went silent
    step: int | None = None      # the step it went silent in
    failure: int | None = None   # the run's failure that fenced it (``Recovery``)


class Fences:
    def __init__(self, pool: WorkerPool, timeout_s: float, run_name: str, memory: MemoryKills | None = None):
        self.pool, self.timeout_s, self.run_name, self.memory = pool, timeout_s, run_name, memory
        self.fenced: dict[int, Fenced] = {}
        self.points = NO_POINTS    # a fault campaign's (controller.run.fault_points)

    def fence(self, wids, step: int | None = None, failure: int | None = None) -> list[int]:
        """Take the silent workers ``wids`` out of the pool without killing them; those fenced.
        ``step``, ``failure``: the step they went silent in, and the run's failure it was."""
        out = []
        for h in self.pool.take(wids):
            rank, h.rank = h.rank, None
            self.fenced[h.wid] = Fenced(h, time.monotonic(), h.actor.ping.remote(), rank=rank, step=step,
                                        failure=failure)
            out.append(h.wid)
            log.warning("[%s] fencing worker %d (node %s) out of the plan: silent; it is kept, and let back in "
                        "as a spare if it answers within failure.fence_timeout_s (%gs)", self.run_name, h.wid,
                        h.node[:12], self.timeout_s)
        if out:
            self.points.reach("fenced", step=step, workers=out)
        return out

    def poll(self) -> list[dict]:
        """Without waiting: let back in, as spares, the fenced workers whose ping answered; forget
        those that died; kill those silent past the timeout. Their ``fence`` events."""
        events = []
        now = time.monotonic()
        for wid, f in list(self.fenced.items()):
            ready, _ = ray.wait([f.ask], timeout=0)
            if ready:
                try:
                    got = ray.get(f.ask)
                except ray.exceptions.RayError as e:
                    del self.fenced[wid]
                    events.append(self._event(f, "died", f"{type(e).__name__}", now))
                    if self.memory is not None and f.failure is not None:
                        self.memory.watch([replace(f.handle, rank=f.rank)], f.step, f.failure)
                    continue
                if f.resetting:
                    del self.fenced[wid]
                    self.pool.readmit(f.handle)
                    events.append(self._event(f, "readmitted", "it answered again: back as a spare", now))
                    log.warning("[%s] worker %d answered %.1f s after it was fenced: back as a spare (a false "
                                "suspicion)", self.run_name, wid, now - f.since)
                    continue
                if f.answered and not got.get("busy"):
                    if f.handle.node in self.pool.avoided:
                        # Its host is avoided (a memory kill there): back as a spare, it would be
                        # given the load that did not fit again.
                        del self.fenced[wid]
                        kill_actor(f.handle.actor)
                        events.append(self._event(f, "killed", "it answered again, on a host avoided after "
                                                               "a memory kill", now))
                        continue
                    # Its old groups and stage go first; it is back in the pool once they have gone.
                    f.resetting, f.ask = True, f.handle.actor.reset.remote()
                    continue
                # Awake; back once the step it was paused in has ended (its groups were cut, so it
                # fails at once): a reset must not run beside it.
                f.answered, f.ask = True, f.handle.actor.group_state.remote()
            if now - f.since > self.timeout_s:
                del self.fenced[wid]
                kill_actor(f.handle.actor)
                events.append(self._event(f, "killed", f"not back within failure.fence_timeout_s "
                                                       f"({self.timeout_s:g}s)", now))
        return events

    def clear(self) -> None:
        """The run ends: kill whoever is still fenced."""
        for f in self.fenced.values():
            kill_actor(f.handle.actor)
        self.fenced = {}

    @staticmethod
    def _event(f: Fenced, outcome: str, detail: str, now: float) -> dict:
        return {"kind": "fence", "worker": f.handle.wid, "node": f.handle.node, "outcome": outcome,
                "fenced_s": round(now - f.since, 3), "detail": detail}

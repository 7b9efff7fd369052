"""Whether a dead worker was killed for memory: asked of its node beside the recovery, never on its path.

A worker past its host's (or container's) memory limit is SIGKILLed by the
kernel, which Ray reports as any other death. The kernel counts those kills
per memory cgroup (``worker.memory_kills``): each worker reads the count of its
own when it joins, and after the death of one whose cgroup has a limit the
controller asks its node for it again, with a task pinned there (a process
started on that node: not worth it where nothing limits the memory). The
answer comes while the re-plan runs, or a step or two later, and is read
without waiting (``poll``). A count
that rose is a memory kill: an event says so, and no worker of the run is
started on that host again (``WorkerPool.avoid``), so the re-plan and growth
do not put the same load back where it did not fit. A node that died whole
answers nothing, and nothing is said. A worker Ray's own memory monitor
killed says so in its error (``failures.diagnose``): that is known at once
(``found``).
"""

from __future__ import annotations

import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..run.workers import WorkerHandle, WorkerPool

# A node that neither answers nor is declared dead in this long is given up on.
_GIVE_UP_S = 300.0


@ray.remote(num_cpus=0, max_retries=0)
def _oom_kills_here() -> int | None:
    from ...worker.memory_kills import oom_kills

    return oom_kills()


class MemoryKills:
    def __init__(self, pool: WorkerPool):
        self.pool = pool
        self._pending: dict = {}          # ref -> (handle, step, failure, count before, asked at)
        self._seen: dict[str, int] = {}   # node -> the count last read there

    def watch(self, dead: list[WorkerHandle], step: int, failure: int) -> None:
        """Ask the nodes of workers that died in ``step`` (the run's ``failure``-th failure) for
        their OOM-kill count (a task each, not waited for). Workers that read no count or no
        limit when they joined are skipped."""
        for h in dead:
            if h.oom_kills is None or h.memory_limit is None:
                continue
            before = max(h.oom_kills, self._seen.get(h.node, h.oom_kills))
            ref = _oom_kills_here.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(h.node, soft=False)).remote()
            self._pending[ref] = (h, step, failure, before, time.monotonic())

    def poll(self, wait_s: float = 0.0) -> list[dict]:
        """The memory kills the answers in so far show (``{"kind": "memory_kill", ...}`` events),
        each host avoided from now on; waits up to ``wait_s`` for the answers still out."""
        if not self._pending:
            return []
        ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=wait_s)
        found = []
        for ref in ready:
            h, step, failure, before, _ = self._pending.pop(ref)
            try:
                count = ray.get(ref)
            except Exception:  # noqa: BLE001 - the node died with its worker: not memory's doing
                continue
            if count is None:
                continue
            # Every answer is the next death's baseline there, a kill or not.
            self._seen[h.node] = max(count, self._seen.get(h.node, 0))
            if count > before:
                found.append(self._found(h, step, failure, "the kernel's OOM killer", count - before))
        now = time.monotonic()
        for ref, (*_, asked) in list(self._pending.items()):
            if now - asked > _GIVE_UP_S:
                del self._pending[ref]
                ray.cancel(ref, force=False)
        return found

    def found(self, dead: list[WorkerHandle], step: int, failure: int) -> list[dict]:
        """Workers whose error says Ray's memory monitor killed them in ``step``: their events,
        each host avoided from now on."""
        return [self._found(h, step, failure, "Ray's memory monitor", None) for h in dead]

    def _found(self, h: WorkerHandle, step: int, failure: int, by: str, kills: int | None) -> dict:
        let_go = self.pool.avoid(h.node)
        limit = f" (limit {h.memory_limit / 2**30:.2f} GB)" if h.memory_limit else ""
        return {"kind": "memory_kill", "worker": h.wid, "rank": h.rank, "node": h.node, "step": step,
                "failure": failure, "by": by,
                "oom_kills": kills, "let_go": let_go,
                "detail": f"worker {h.wid} (rank {h.rank}) was killed by {by} on node {h.node[:12]} ({h.ip}){limit} "
                          f"in step {step}; no worker of this run is started there again"}

"""Preemption notices: a node Ray drains is left before its deadline, as a planned re-plan.

Clouds warn before they take a spot node (up to 120 s on one, about 30 s on another), and Ray
turns the warning into a drain: the GCS marks the node draining, with a deadline, and places
nothing new there. The controller reads the draining nodes every few seconds (one GCS read,
never a call per rank). A drain of a node that hosts ranks of the run asks for a re-plan the
way a grow does (``Growth.request_replan("drain")``): the next step takes a snapshot, and the
re-plan right after it restores that step on the workers that are not leaving (``Bench.usable``
leaves out those on draining nodes), so nothing is redone and no failure is counted. A spare
elsewhere takes the leaving ranks and the layout stays; with none, the plan shrinks as after a
loss and grows back when capacity returns. Placement never picks a draining node
(``placement.free_slots``). A drain of a node with no rank (the head, a spare) lets its spares
go and costs nothing; a drain cancelled lets the node be used again.
"""

from __future__ import annotations

import logging
import time

import ray

from ..run.placement import draining_nodes
from ..run.run_record import RunRecord
from ..run.workers import WorkerPool

log = logging.getLogger(__name__)

# How often the draining nodes are read: a notice of 30 s loses at most this much of it.
CHECK_S = 2.0
# A drain's re-plan waits for the replacements started at the notice while its deadline is more
# than this far (a re-plan between steps takes about a second; the rest is room for a slow step),
# or, with no deadline, this long at most.
MARGIN_S = 4.0
WAIT_S = 30.0


class Drains:
    """Watches Ray's drains for the run (``poll``); ``replan(reason)`` asks for the re-plan."""

    def __init__(self, run: RunRecord, pool: WorkerPool, replan, check_s: float = CHECK_S, read=draining_nodes):
        self.run, self.pool, self._replan, self.check_s, self._read = run, pool, replan, check_s, read
        self._last = float("-inf")
        self.noticed: dict[str, float] = {}   # node -> when its drain was noticed (monotonic)

    def poll(self) -> None:
        """Read the drains if a read is due, and act on what changed."""
        now = time.monotonic()
        if now - self._last < self.check_s:
            return
        self._last = now
        notices = self._read()
        if not notices and not self.pool.draining:
            return
        for node, deadline in notices.items():
            if node not in self.pool.draining:
                self._notice(node, deadline)
        # Workers moved off a draining node hold no rank: let them go now, so the node's end at
        # its deadline takes nothing of the run's.
        moved = [h.wid for h in self.pool.handles() if h.node in self.pool.draining and h.rank is None]
        if moved:
            self.pool.drop(moved)
            self.run.event("drain", step=self.run.step, action="moved off", let_go=moved,
                           nodes=sorted(self.pool.draining))
        ended = [n for n in self.pool.draining if n not in notices]
        if ended:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        for node in ended:
            self.pool.undrain(node)
            self.noticed.pop(node, None)
            self.run.event("drain", node=node, step=self.run.step, action="ended",
                           detail="the drain was cancelled" if node in alive else "the node is gone")

    def ready(self) -> bool:
        """Whether a drain's re-plan may go now: no replacement is still starting, or waiting for
        one would leave less than ``MARGIN_S`` before the nearest deadline (or the notice is
        ``WAIT_S`` old, where no deadline was given)."""
        self.pool.await_joining(0, required=False)
        if not self.pool.joining:
            return True
        now, mono = time.time(), time.monotonic()
        deadlines = [d for d in self.pool.draining.values() if d is not None]
        if deadlines and min(deadlines) - now < MARGIN_S:
            return True
        return any(mono - t > WAIT_S for t in self.noticed.values())

    def _notice(self, node: str, deadline: float | None) -> None:
        ranks = sorted(h.rank for h in self.pool.handles() if h.node == node and h.rank is not None)
        let_go = self.pool.drain(node, deadline)
        self.noticed[node] = time.monotonic()
        left = None if deadline is None else round(deadline - time.time(), 3)
        if ranks:
            self.pool.spawn_on_free_nodes()   # replacements, started now, joined by the re-plan if in time
            self._replan("drain")
            action = "re-plan off it at the next step"
        else:
            action = "nothing to move: no rank of the run there"
        log.warning("[%s] node %s is draining (%s): %s", self.run.name, node[:12],
                    "no deadline" if left is None else f"{left:.1f} s left", action)
        self.run.event("drain", node=node, step=self.run.step, deadline=deadline, left_s=left, ranks=ranks,
                       let_go=let_go, action=action)

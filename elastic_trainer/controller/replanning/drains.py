"""Preemption notices: a node Ray drains is left before its deadline, as a planned re-plan.

Clouds warn before they take a spot node (up to 120 s on one, about 30 s on another), and Ray
turns the warning into a drain: the GCS marks the node draining, with a deadline, and places
nothing new there. The controller reads the draining nodes every few seconds (one GCS read,
never a call per rank). A drain of a node that hosts ranks of the run asks for a re-plan the
way a grow does (``Growth.request_replan("drain")``): the next step takes a snapshot, and the
re-plan right after it restores that step on the workers that are not leaving (``Bench.usable``
leaves out those on draining nodes), so nothing is redone and no failure is counted. A spare
elsewhere takes the leaving ranks at once and the layout stays. With none, the node's ranks
train on while it lives (a snapshot at the next step covers an early end), and the run moves
off it shortly before the deadline (``leave_by_s``) or as soon as a spare is ready, shrinking
as after a loss and growing back when capacity returns. Placement never picks a draining node
(``placement.free_slots``). A drain of a node with no rank (the head, a spare) lets its spares
go and costs nothing; a drain cancelled lets the node be used again.

A notice too short to move in (``enough_notice``: the time left against ``move_seconds``, the
next step, a re-plan's fixed part and the largest rank's state at the rate the last set-up
measured) is not raced: the next step takes a snapshot, the run trains on until the node
goes, and the loss at the deadline restores from that snapshot, redoing little; a node that
outlives its deadline is then moved off as with a longer notice. The drain event says which was
done (``outcome``: moved, loss; idle where no rank was there).
"""

from __future__ import annotations

import logging
import time

import ray

from ..run.placement import draining_nodes
from ..run.run_record import RunRecord
from ..run.workers import WorkerPool
from .setup_time import DEFAULT_BYTES_PER_S

log = logging.getLogger(__name__)

# How often the draining nodes are read: a notice of 30 s loses at most this much of it.
CHECK_S = 2.0
# A drain's re-plan waits for the replacements started at the notice while its deadline is more
# than this far (a re-plan between steps takes about a second; the rest is room for a slow step),
# or, with no deadline, this long at most.
MARGIN_S = 4.0
WAIT_S = 30.0
# A re-plan's part that does not grow with the bytes (choosing, groups, building): about a
# second on the demo (docs/runtime.md "Preemption notices").
REPLAN_FIXED_S = 1.0
# A node left to the loss path that is still there this long after its deadline is moved off.
OUTLIVED_S = 2.0
# With no spare to move to, ranks stay on a draining node (it trains until its deadline) until
# this much before the last safe moment to move: a read of the drains, a lease, a slow re-plan.
LEAVE_SLACK_S = CHECK_S + 3.0


def move_seconds(step_s: float | None, rank_bytes: int, bytes_per_s: float | None) -> float:
    """About how long moving ranks off a node takes: the next step (it takes the snapshot the
    re-plan restores), a re-plan's fixed part, and the largest rank's state at ``bytes_per_s``
    (the rate the last set-up measured; else a conservative 50 MB/s)."""
    return (step_s or 1.0) + REPLAN_FIXED_S + rank_bytes / (bytes_per_s or DEFAULT_BYTES_PER_S)


def leave_by_s(need_s: float) -> float:
    """How long before its deadline a draining node with ranks and no spare is left: the move's
    room (``enough_notice``) and ``LEAVE_SLACK_S`` to find that moment late."""
    return 1.5 * need_s + 1.0 + LEAVE_SLACK_S


def enough_notice(left_s: float | None, need_s: float) -> bool:
    """Whether ``left_s`` before the deadline (None: no deadline) leaves room to move: half as
    long again as the estimate, and a second, for a slow step and a notice read late."""
    return left_s is None or left_s >= 1.5 * need_s + 1.0


class Drains:
    """Watches Ray's drains for the run (``poll``); ``replan(reason)`` asks for the re-plan."""

    def __init__(self, run: RunRecord, pool: WorkerPool, replan, snapshot=lambda: None, check_s: float = CHECK_S,
                 read=draining_nodes, alive=lambda: {n["NodeID"] for n in ray.nodes() if n.get("Alive")}):
        """``replan(reason)`` asks for a re-plan at the next snapshot step, ``snapshot()`` for a
        snapshot at the next step; ``estimate()`` (set by the controller) says how long a move
        takes now (``move_seconds``). ``read()``: the draining nodes and their deadlines;
        ``alive()``: the nodes alive."""
        self.run, self.pool, self._replan, self._snapshot = run, pool, replan, snapshot
        self.check_s, self._read, self._alive = check_s, read, alive
        self.estimate = lambda: move_seconds(None, 0, None)
        self._last = float("-inf")
        self.noticed: dict[str, float] = {}   # node -> when its drain was noticed (monotonic)
        self._losing: set[str] = set()        # draining nodes with ranks left to the loss path
        self._staying: set[str] = set()       # draining nodes whose ranks train on until near the deadline

    def poll(self) -> None:
        """Read the drains if a read is due, and act on what changed."""
        now = time.monotonic()
        if now - self._last < self.check_s:
            return
        self._last = now
        notices = self._read()
        quarantined = [h.wid for h in self.pool.handles() if h.rank is None
                       and (h.node in self.pool.quarantined or h.wid in self.pool.quarantined_workers)
                       ] if self.pool.quarantined or self.pool.quarantined_workers else []
        if quarantined:   # moved off a quarantined node: let go
            self.pool.drop(quarantined)
            self.run.event("quarantine", step=self.run.step, action="moved off", let_go=quarantined,
                           nodes=sorted(self.pool.quarantined))
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
            first = min((self.noticed[n] for n in self.pool.draining if n in self.noticed), default=now)
            self.run.event("drain", step=self.run.step, action="moved off", let_go=moved,
                           nodes=sorted(self.pool.draining), seconds=round(now - first, 3))
        for node in sorted(self._staying):
            if node not in notices:
                continue   # ended: below
            if not any(h.node == node and h.rank is not None for h in self.pool.handles()):
                self._staying.discard(node)   # another re-plan (a grow, a loss) took its ranks off
                continue
            spare = self._spare()
            left = None if notices[node] is None else notices[node] - time.time()
            if spare or left is None or left <= leave_by_s(self.estimate()):
                self._staying.discard(node)
                self._replan("drain")
                self.run.event("drain", node=node, step=self.run.step, outcome="moved",
                               action="a spare is ready: re-plan off it at the next step" if spare
                               else "re-plan off it at the next step" + ("" if left is None else
                                                                         f", {left:.1f} s before its deadline"))
        for node in sorted(self._losing):
            deadline = notices.get(node)
            if node in notices and deadline is not None and time.time() > deadline + OUTLIVED_S:
                # The cloud did not take it at its deadline: it may go any time yet, and there is
                # now all the time a move needs.
                self._losing.discard(node)
                self._replan("drain")
                self.run.event("drain", node=node, step=self.run.step, action="outlived its deadline: re-plan "
                               "off it at the next step", outcome="moved")
        ended = [n for n in self.pool.draining if n not in notices]
        if ended:
            alive = self._alive()
        for node in ended:
            self.pool.undrain(node)
            self.noticed.pop(node, None)
            self._losing.discard(node)
            self._staying.discard(node)
            self.run.event("drain", node=node, step=self.run.step, action="ended",
                           detail="the drain was cancelled" if node in alive else "the node is gone")

    def losing(self) -> bool:
        """Whether a node with ranks is left to the loss path at its deadline: until it goes, the
        steps run one at a time, so the snapshot asked for comes at the next step, not at the
        end of a lease, and each step after it is one more that a loss need not redo."""
        return bool(self._losing & set(self.pool.draining))

    def _spare(self) -> bool:
        """Whether a worker is starting, or idle and not leaving, to take a leaving rank."""
        return bool(self.pool.joining) or any(h.rank is None and h.node not in self.pool.draining
                                              for h in self.pool.handles())

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
        need = None
        if not ranks:
            outcome, action = "idle", "nothing to move: no rank of the run there"
        else:
            self.pool.spawn_on_free_nodes()   # replacements, started now, joined by a re-plan if in time
            need = round(self.estimate(), 3)
            if enough_notice(left, need) and (self._spare() or left is None or left <= leave_by_s(need)):
                self._replan("drain")
                outcome, action = "moved", "re-plan off it at the next step"
            elif enough_notice(left, need):   # room to move, no spare to move to
                # No spare to move to: moving now would shrink the run for the whole notice. The
                # node trains until shortly before its deadline (or until a spare is ready), and
                # a snapshot at the next step covers a node that goes early.
                self._snapshot()
                self._staying.add(node)
                outcome = "moved"
                action = (f"no spare: train on it, and re-plan off it {leave_by_s(need):.1f} s before its "
                          "deadline or once a spare is ready")
            else:
                # A move that cannot finish before the node goes would fail half-way: snapshot
                # now, train on, and take the loss at the deadline from that snapshot.
                self._snapshot()
                self._losing.add(node)
                outcome = "loss"
                action = (f"snapshot at the next step, then the loss path at the deadline: {left:.1f} s left, "
                          f"moving needs about {need:.1f} s")
        log.warning("[%s] node %s is draining (%s): %s", self.run.name, node[:12],
                    "no deadline" if left is None else f"{left:.1f} s left", action)
        self.run.event("drain", node=node, step=self.run.step, deadline=deadline, left_s=left, ranks=ranks,
                       let_go=let_go, action=action, outcome=outcome, move_estimate_s=need)

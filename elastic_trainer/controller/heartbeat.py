"""The heartbeat of one step's wait: who has gone unheard of for the whole timeout.

A rank whose step runs long is asked after every quarter of
``failure.heartbeat_timeout_s`` once the step has run that long; one unheard
of for the whole timeout since a question asked after it is lost
(``StepOutcome.silent``, docs/runtime.md "When nodes die"). A frozen node
keeps its sockets open, so nothing else would tell before the step timeout.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import ray


class Heartbeat:
    """The heartbeats of one step's wait (see the module docstring): a rank is silent once a
    heartbeat that asked after it has gone unanswered for the whole timeout.

    One question a node, not a rank (``TrainWorker.ping_node``): a worker there answers, and
    says of its node-mates whether their processes run (``worker.liveness``), so the calls
    grow with the nodes (a long lease at N = 32 sent about 54 pings a step, most of the
    controller's CPU). A question a round unanswered asks again through another worker of the
    node (the one asked may be the frozen one). A rank no node-mate can vouch for (no /proc,
    its process unknown there) is asked on its own."""

    def __init__(self, timeout_s: float | None, started: float, actors: dict[int, object],
                 where: Callable[[int], tuple | None] | None = None):
        self.timeout_s, self.actors = timeout_s, actors
        self.where = where or (lambda w: None)     # worker id -> (node, pid, mark), or None
        self.next_at = started + timeout_s / 4 if timeout_s else float("inf")
        self.refs: dict = {}                       # question in flight -> (asked, sent at, ranks it covers)
        self.waiting: dict[int, float] = {}        # worker id -> when it was first asked after since it was heard
        self.direct: set[int] = set()              # asked on their own: no node-mate could vouch for them
        self.sent_last = 0

    def answer(self, ref) -> None:
        """A question came back (a dead worker's fails; its step ref says how it died)."""
        asked = self.refs.pop(ref, None)
        if asked is None:
            return
        who, _, covers = asked
        try:
            states = ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 - the asked worker is gone; its step's own ref tells
            return
        for w in covers:
            state = True if w == who else states.get(w)
            if state:
                self.waiting.pop(w, None)
            elif state is None:
                self.direct.add(w)   # stopped reads False and stays unheard; unknown is asked itself

    def heard_again(self, wids: list[int]) -> None:
        """These answered otherwise: they are not waited on."""
        for w in wids:
            self.waiting.pop(w, None)

    def _group(self, w: int):
        loc = self.where(w)
        return ("rank", w) if loc is None or loc[2] is None or w in self.direct else loc[0]

    def tick(self, pending: list[int]) -> list[int]:
        """The ``pending`` workers unheard of for the whole timeout since a question asked after
        them; if none, send the next questions."""
        if self.refs:
            # Every answer that has come, not only those the wait handed over one by one: a
            # controller held up meanwhile must not read queued answers as silence.
            ready, _ = ray.wait(list(self.refs), num_returns=len(self.refs), timeout=0)
            for ref in ready:
                self.answer(ref)
        now = time.perf_counter()
        silent = [w for w in pending if w in self.waiting and now - self.waiting[w] >= self.timeout_s]
        if silent:
            self.sent_last = 0
            return silent
        groups: dict = collections.defaultdict(list)
        for w in pending:
            groups[self._group(w)].append(w)
        asked: dict = collections.defaultdict(list)
        for who, sent, _ in self.refs.values():
            asked[self._group(who)].append((who, sent))
        self.sent_last = 0
        for key, members in groups.items():
            out = asked.get(key, [])
            if any(now - sent < self.timeout_s / 4 for _, sent in out):
                continue   # asked this round
            busy = {who for who, _ in out}
            free = [w for w in members if w not in busy]
            if not free:
                continue
            who = free[0]
            mates = {} if isinstance(key, tuple) else {w: self.where(w)[1:] for w in members if w != who}
            self.refs[self.actors[who].ping_node.remote(mates)] = (who, now, members)
            for w in members:
                self.waiting.setdefault(w, now)
            self.sent_last += 1
        oldest = min([self.waiting[w] for w in pending if w in self.waiting] + [now])
        self.next_at = min(now + self.timeout_s / 4, oldest + self.timeout_s)
        return []

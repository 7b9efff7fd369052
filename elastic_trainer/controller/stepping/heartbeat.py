"""The heartbeat of one step's wait: who has gone unheard of for the whole timeout.

A rank whose step runs long is asked after every quarter of
``failure.heartbeat_timeout_s`` once the step has run that long; one unheard
of for the whole timeout since it was last heard (its step began, or it
answered), with a question out to it a quarter of the timeout at least, is
lost (``StepOutcome.silent``, docs/runtime.md "When nodes die"). A frozen node
keeps its sockets open, so nothing else would tell before the step timeout.
The timeout counts from the last answer, not from the first question left
unanswered: that would add up to a quarter of it to every detection (a
question goes a quarter after the last answer) for no more certainty, since
a live rank answers each question within milliseconds.

The questions go one a node, and past ``failure.heartbeat_fanout`` nodes
through relays: the controller asks one worker per ``fanout`` nodes, which
asks those nodes and answers for them all (``worker.heartbeat_relay``), so
the controller's questions a round grow as nodes / fanout. A relay that does
not answer within the round leaves its nodes unheard; the next round asks
them through another relay, picked from the workers heard last, so a frozen
relay costs its healthy nodes one round, never the timeout.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import ray


class Heartbeat:
    """The heartbeats of one step's wait (see the module docstring): a rank is silent once it
    has gone unheard of for the whole timeout, with a heartbeat that asked after it unanswered.

    One question a node, not a rank (``TrainWorker.ping_node``): a worker there answers, and
    says of its node-mates whether their processes run (``worker.liveness``), so the calls
    grow with the nodes (a long lease at N = 32 sent about 54 pings a step, most of the
    controller's CPU). A question a round unanswered asks again through another worker of the
    node (the one asked may be the frozen one). A rank no node-mate can vouch for (no /proc,
    its process unknown there) is asked on its own. Past ``fanout`` nodes a round, the
    questions go through relays (``TrainWorker.relay_pings``)."""

    def __init__(self, timeout_s: float | None, started: float, actors: dict[int, object],
                 where: Callable[[int], tuple | None] | None = None, fanout: int = 16):
        self.timeout_s, self.actors, self.fanout = timeout_s, actors, max(2, fanout)
        self.where = where or (lambda w: None)     # worker id -> (node, pid, mark), or None
        self.next_at = started + timeout_s / 4 if timeout_s else float("inf")
        # question in flight -> (relay or None, sent at, {worker asked: the ranks it covers})
        self.refs: dict = {}
        self.asked_at: dict = {}                   # group (node, or a rank) -> when last asked
        self.waiting: dict[int, float] = {}        # worker id -> when it was first asked after since it was heard
        self.started = started
        self.heard: dict[int, float] = {}          # worker id -> when it was last heard (else: ``started``)
        self.direct: set[int] = set()              # asked on their own: no node-mate could vouch for them
        self.unanswered: set[int] = set()          # asked and not answered: asked last next time
        self.sent_last = 0
        self._round = 0

    def answer(self, ref) -> None:
        """A question came back (a dead worker's fails; its step ref says how it died)."""
        asked = self.refs.pop(ref, None)
        if asked is None:
            return
        relay, _, asks = asked
        try:
            got = ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 - the asked worker is gone; its step ref tells
            self.unanswered.update(asks if relay is None else [relay])
            return
        if relay is None:
            got = {who: got for who in asks}
        else:
            self.unanswered.discard(relay)
            self._heard(relay)   # it answered: alive, whatever its nodes said
        for who, covers in asks.items():
            states = got.get(who)
            if states is None:
                self.unanswered.add(who)   # the relay heard nothing from it this round
                continue
            self.unanswered.discard(who)
            for w in covers:
                state = True if w == who else states.get(w)
                if state:
                    self._heard(w)
                elif state is None:
                    self.direct.add(w)   # stopped reads False and stays unheard; unknown is asked itself

    def heard_again(self, wids: list[int]) -> None:
        """These answered otherwise: they are not waited on."""
        for w in wids:
            self._heard(w)

    def _heard(self, w: int) -> None:
        self.waiting.pop(w, None)
        self.heard[w] = time.perf_counter()

    def _silent_at(self, w: int) -> float:
        """When ``w``, asked after at ``waiting[w]`` and unheard since, counts as silent: the
        whole timeout after it was last heard, its question out a quarter of it at least (one
        asked a moment ago has had no time to be answered)."""
        return max(self.heard.get(w, self.started) + self.timeout_s, self.waiting[w] + self.timeout_s / 4)

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
        silent = [w for w in pending if w in self.waiting and now >= self._silent_at(w)]
        if silent:
            self.sent_last = 0
            return silent
        groups: dict = collections.defaultdict(list)
        for w in pending:
            groups[self._group(w)].append(w)
        # Busy: a worker asked itself and not yet answered, or a relay with a question out. Those
        # a relay was to ask are not: a frozen relay must not keep its nodes from being asked.
        busy: set[int] = set()
        for relay, sent, asked in self.refs.values():
            busy |= set(asked) if relay is None else {relay}
            if relay is not None and now - sent >= self.timeout_s / 4:
                self.unanswered.add(relay)
        asks: list[tuple] = []   # (worker asked, its node-mates' processes, the ranks it covers)
        for key, members in groups.items():
            if now - self.asked_at.get(key, -float("inf")) < self.timeout_s / 4:
                continue   # asked this round
            # One not asked yet, or asked and answered, before one that left a question unanswered.
            free = sorted((w for w in members if w not in busy), key=lambda w: w in self.unanswered)
            if not free:
                continue
            who = free[0]
            mates = {} if isinstance(key, tuple) else {w: self.where(w)[1:] for w in members if w != who}
            asks.append((who, mates, members))
            self.asked_at[key] = now
            for w in members:
                self.waiting.setdefault(w, now)
        self.sent_last = self._send(asks, pending, busy, now)
        self.next_at = min([now + self.timeout_s / 4] + [self._silent_at(w) for w in pending if w in self.waiting])
        return []

    def _send(self, asks: list[tuple], pending: list[int], busy: set[int], now: float) -> int:
        """Send this round's questions: each its own, or past ``fanout`` through relays."""
        if len(asks) <= self.fanout:
            for who, mates, members in asks:
                self.refs[self.actors[who].ping_node.remote(mates)] = (None, now, {who: members})
            return len(asks)
        chunks = [asks[i:i + self.fanout] for i in range(0, len(asks), self.fanout)]
        # Relays from the workers heard last (else those not yet asked, else the rest), none of
        # them asked in its own chunk (a frozen node must not be the one to vouch for its
        # neighbours), turning each round.
        free = [w for w in pending if w not in busy]
        tiers = [[w for w in free if w not in self.waiting and w not in self.unanswered],
                 [w for w in free if w in self.waiting and w not in self.unanswered],
                 [w for w in free if w in self.unanswered]]
        self._round += 1
        sent = 0
        for i, chunk in enumerate(chunks):
            inside = {w for _, _, members in chunk for w in members}
            pick = next((t for t in ([w for w in tier if w not in inside] for tier in tiers) if t), [chunk[0][0]])
            relay = pick[(self._round + i) % len(pick)]
            handles = {who: (self.actors[who], mates) for who, mates, _ in chunk}
            ref = self.actors[relay].relay_pings.remote(handles, self.timeout_s / 8)
            self.refs[ref] = (relay, now, {who: members for who, _, members in chunk})
            sent += 1
        return sent

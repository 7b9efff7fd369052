"""Named points of a run's own phases where a fault campaign strikes (``chaos.campaign``).

A campaign names a fault's moment by what the run is doing, never by wall time: a step in
flight, between steps, a snapshot in flight, a set-up, a restore, a durable write, the final
save, a grow just ordered, a worker just fenced. The controller passes each such point
(``reach``); where one is armed, it holds there until the campaign has struck and lets it go
(``release``), so the fault lands in that phase every time the schedule is replayed.

They exist only where ``failure.allow_fault_injection`` is set: every other run gets
``NO_POINTS``, whose ``reach`` does nothing.
"""

from __future__ import annotations

import threading
import time

POINTS = ("in_step", "between_steps", "snapshot_in_flight", "setup", "restore", "durable_write", "final_save",
          "grow_ordered", "fenced")


class FaultPoints:
    """The points a run has passed, and the one it holds at. ``hold_s``: how long a held point
    waits for ``release`` before it goes on by itself (a campaign that died must not hang a run)."""

    def __init__(self, hold_s: float = 120.0):
        self.hold_s = hold_s
        self._cv = threading.Condition()
        self._armed: dict[str, set[int]] = {}   # point -> the occurrences to hold at
        self._passed: dict[str, int] = {}    # point -> times passed
        self._held: dict | None = None       # the point held now: name, occurrence, what the run said of it
        self._released = 0                   # releases so far, so a hold knows its own

    def arm(self, point: str, occurrence: int = 1) -> int:
        """Hold at the ``occurrence``-th time the run passes ``point`` from now (1: the next); that
        pass's number since the start, which ``held`` names as its ``occurrence``."""
        if point not in POINTS:
            raise ValueError(f"unknown fault point {point!r}; points: {', '.join(POINTS)}")
        if occurrence < 1:
            raise ValueError(f"occurrence {occurrence} of {point!r}: counts from 1 (the next time it is passed)")
        with self._cv:
            n = self._passed.get(point, 0) + occurrence
            self._armed.setdefault(point, set()).add(n)
            return n

    def reach(self, point: str, **what) -> None:
        """The run passes ``point``; ``what`` says where it stands (a step, the workers set up)."""
        with self._cv:
            n = self._passed[point] = self._passed.get(point, 0) + 1
            if n not in self._armed.get(point, ()):
                return
            self._armed[point].discard(n)
            # One hold at a time: a point reached on another thread (the durable writer's, beside
            # the loop's) while one is held waits its turn, so the campaign sees each.
            self._cv.wait_for(lambda: self._held is None, timeout=self.hold_s)
            self._held = {"point": point, "occurrence": n, "at": time.time(), **what}
            mine = self._released
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._released > mine, timeout=self.hold_s)
            self._held = None
            self._cv.notify_all()

    def held(self) -> dict | None:
        """The point the run holds at now (None: none), with what it said of it."""
        with self._cv:
            return dict(self._held) if self._held else None

    def release(self) -> None:
        """Let the held point go on."""
        with self._cv:
            self._released += 1
            self._cv.notify_all()

    def state(self) -> dict:
        """Points passed so far (name -> count), those armed, and the one held."""
        with self._cv:
            return {"passed": dict(self._passed), "armed": {p: sorted(n) for p, n in self._armed.items() if n},
                    "held": dict(self._held) if self._held else None}


class _NoPoints:
    """A run without fault injection: nothing is armed, held or counted."""

    def reach(self, point: str, **what) -> None:
        pass


NO_POINTS = _NoPoints()

"""Shrinking a failing schedule: the fewest of its faults that still fail, each tried without.

A schedule has few faults (one or two), so greedy removal is the whole search: drop each fault
in turn, keep the drop wherever the rest still fails, until no single drop does. A fault whose
moment counts from the one before keeps its point and occurrence, now counted from the one
before it in what is left.
"""

from __future__ import annotations

from typing import Callable

from .schedule import Schedule


def shrink(schedule: Schedule, fails: Callable[[Schedule], bool]) -> Schedule:
    """The smallest sub-schedule of ``schedule`` (which fails) for which ``fails`` still holds."""
    current = schedule
    changed = True
    while changed and len(current.faults) > 1:
        changed = False
        for i in range(len(current.faults)):
            candidate = Schedule(current.faults[:i] + current.faults[i + 1:], current.seed)
            if fails(candidate):
                current, changed = candidate, True
                break
    return current

"""Who is slow: each rank's pace from its own compute, robust to blips, and the straggler events.

A rank's *pace* is its compute this step (``worker.compute_clock``: passes and
update, not its waits) against what it should take:

- against the ranks holding the same stage in other replicas (the same work),
  where there are any: its compute over theirs, at the same step, so a
  slowdown of the whole cluster moves nobody;
- else (one replica) against its own compute over the first ``window`` steps of
  the plan: a slowdown that starts mid-run shows; one present from the first
  step of a one-replica plan does not.

A rank is a straggler when, over the last ``window`` steps, the median of its
pace exceeds ``1 + threshold`` (so a blip of fewer than half the window's
steps moves nothing) and a one-sided test says the window's mean log pace is
above ``log(1 + threshold)`` by more than ``CHANGE_T`` standard errors: a rank
whose pace merely wanders around the line, as a worker's share of an
oversubscribed host does, is not named. It stops being one when the median
falls below ``1 + threshold / 2`` (the gap keeps a rank near the line from
flapping).
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics
from dataclasses import dataclass, field

# Standard errors by which a window's mean log pace must clear log(1 + threshold).
CHANGE_T = 2.5


def _clears(paces, line: float) -> bool:
    """Whether the mean log pace of ``paces`` is above ``log(line)`` by ``CHANGE_T`` standard errors."""
    logs = [math.log(max(p, 1e-9)) for p in paces]
    excess = statistics.fmean(logs) - math.log(line)
    if excess <= 0:
        return False
    sd = statistics.stdev(logs) if len(logs) > 1 else 0.0
    return sd == 0 or excess / (sd / math.sqrt(len(logs))) > CHANGE_T


def _median_without(ordered: list[float], value: float) -> float:
    """The median of sorted ``ordered`` less one occurrence of ``value``, without copying it:
    each rank's reference is its peers' median, and a copy per rank made a step O(N^2)
    (59 ms a step at 1,000 ranks)."""
    i = bisect.bisect_left(ordered, value)
    m = len(ordered) - 1

    def at(k: int) -> float:   # the k-th of the rest
        return ordered[k] if k < i else ordered[k + 1]
    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


@dataclass
class _Rank:
    stage: int
    paces: collections.deque
    computes: collections.deque                      # its own compute seconds over the same window
    baseline: list = field(default_factory=list)   # own compute over the plan's first window (one replica)
    slow_since: int | None = None                   # step the current straggling started


class PaceTracker:
    """Per-rank pace over a window, and the straggler events it implies (pure: no Ray)."""

    def __init__(self, threshold: float = 0.15, window: int = 10):
        if threshold <= 0 or window < 2:
            raise ValueError(f"balance.threshold must be > 0 and balance.window >= 2; got {threshold}, {window}")
        self.threshold, self.window = threshold, window
        self._ranks: dict[int, _Rank] = {}

    def reset(self, stage_of: dict[int, int]) -> None:
        """A new plan (``rank -> stage``): paces start again, nobody is a straggler."""
        self._ranks = {r: _Rank(s, collections.deque(maxlen=self.window), collections.deque(maxlen=self.window))
                       for r, s in stage_of.items()}

    def update(self, step: int, compute: dict[int, float], hold: set[int] = frozenset()
               ) -> tuple[dict[int, float], list[dict]]:
        """Take ``step``'s compute seconds per rank; returns (median pace per rank so far,
        events: ``straggler`` and ``straggler_recovered``, with their figures). Ranks in
        ``hold`` keep their pace but are not newly named (a replica already worked around)."""
        by_stage: dict[int, list[float]] = collections.defaultdict(list)
        for r, c in compute.items():
            if r in self._ranks:
                by_stage[self._ranks[r].stage].append(c)
        for same in by_stage.values():
            same.sort()   # each rank's peers' median is read off it (_median_without): O(N log N) a step
        events, paces = [], {}
        for r, c in compute.items():
            st = self._ranks.get(r)
            if st is None:
                continue
            st.computes.append(c)
            peers = len(by_stage[st.stage]) > 1
            if peers:
                ref = _median_without(by_stage[st.stage], c)
            elif len(st.baseline) < self.window:
                st.baseline.append(c)
                continue
            else:
                ref = statistics.median(st.baseline)
            st.paces.append(c / ref if ref > 0 else 1.0)
            pace = statistics.median(st.paces)
            paces[r] = pace
            full = len(st.paces) == self.window
            if st.slow_since is None and r not in hold and full and pace > 1 + self.threshold and _clears(st.paces, 1 + self.threshold):
                # Onset: the first step of the window's slow run, the change the median confirmed.
                slow = [i for i, p in enumerate(st.paces) if p > 1 + self.threshold]
                first = slow[0] if slow else self.window - 1
                st.slow_since = step - (self.window - 1 - first)
                # The figures are medians over the slow run since the onset, not over the whole
                # window: named as soon as the median turns, the window still holds the steps
                # before it, and its median read a 3x slowdown as 1.8x (seen in CI). A median,
                # since one step's figure on a shared host can be far off.
                run = self.window - first    # both deques are full here, step-aligned at the end
                since_pace = statistics.median(list(st.paces)[-run:])
                med = statistics.median(list(st.computes)[-run:])
                events.append({"kind": "straggler", "rank": r, "step": step, "since_step": st.slow_since,
                               "pace": round(pace, 3), "slow_pace": round(since_pace, 3),
                               "compute_s": med, "reference_s": med / since_pace,
                               "against": "peers" if peers else "own start"})
            elif st.slow_since is not None and pace < 1 + self.threshold / 2:
                events.append({"kind": "straggler_recovered", "rank": r, "step": step, "pace": round(pace, 3),
                               "slow_steps": step - st.slow_since})
                st.slow_since = None
        return paces, events

    def pace_of(self, rank: int) -> float | None:
        """``rank``'s median pace over the window (None before any)."""
        st = self._ranks.get(rank)
        return statistics.median(st.paces) if st is not None and st.paces else None

    def compute_median(self, rank: int) -> float | None:
        """The median of ``rank``'s compute seconds over the window (None before any)."""
        st = self._ranks.get(rank)
        return statistics.median(st.computes) if st is not None and st.computes else None

    @property
    def stragglers(self) -> dict[int, int]:
        """rank -> the step its straggling started, for the ranks straggling now."""
        return {r: st.slow_since for r, st in self._ranks.items() if st.slow_since is not None}

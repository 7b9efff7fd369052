"""Goodput: where a run's wall time went, bucket by bucket.

The controller's loop is one thread doing one thing at a time: starting, running steps, driving
between them, recovering, evaluating, saving. ``GoodputClock`` charges the wall time to the
bucket of what the loop is doing now (``enter``, ``phase``), so the buckets add up to the wall
time by construction. What is only known afterwards is then moved between buckets (``move``):
the first runs of steps a failure rolled back (training to ``redone``), the part of a failed
step before the failure was known (to ``detection``), an update's wait for a snapshot copy (to
``checkpointing``), and a straggler's share of a step (to ``stragglers``). What stays in
``training`` is the wall time of the steps that count: goodput is that over the wall time.

Work on other threads (durable writes, snapshot copies that do not hold an update up) costs
the run nothing here, as it costs the steps nothing.
"""

from __future__ import annotations

import contextlib
import threading
import time

# Every bucket, in the order reports list them; ``training`` is the good one.
BUCKETS = ("training", "startup", "waiting_for_nodes", "detection", "replan", "restore", "redone",
           "checkpointing", "drains", "resizing", "stragglers", "evaluation", "integrity", "controller")

WHAT = {
    "training": "steps that count (each step once, however often it ran)",
    "startup": "placement, the workers' start and the first set-up, up to the first step",
    "waiting_for_nodes": "waits for enough workers to place a plan on",
    "detection": "failed steps, from their start until the failure was known",
    "replan": "after a failure: choosing the next plan and starting its set-up (failed attempts included)",
    "restore": "after a failure: loading the restored state onto the new plan",
    "redone": "the first runs of steps a failure rolled back",
    "checkpointing": "updates that waited for a snapshot copy; durable writes started between steps; the final save",
    "drains": "re-plans that moved ranks off nodes given notice",
    "resizing": "re-plans onto workers that joined",
    "stragglers": "a slow rank's share of the steps it slowed, and the re-plans that left it out or re-cut",
    "evaluation": "validation passes (eval.every)",
    "integrity": "the replicas' state fingerprinted on check steps (integrity.check_every)",
    "controller": "driving between steps while no step ran: recording, deciding, holds",
}


class GoodputClock:
    """Charges wall time to buckets; thread-safe (``report`` is read from the status thread)."""

    def __init__(self, bucket: str = "startup", clock=time.monotonic):
        _check(bucket)
        self._clock = clock
        self._lock = threading.Lock()
        self._bucket = bucket
        self._since = self._started = clock()
        self._ended: float | None = None
        self._seconds = dict.fromkeys(BUCKETS, 0.0)

    @property
    def bucket(self) -> str:
        return self._bucket

    def enter(self, bucket: str) -> str:
        """From now on charge ``bucket``; the bucket charged until now."""
        _check(bucket)
        with self._lock:
            self._charge()
            prev, self._bucket = self._bucket, bucket
            return prev

    @contextlib.contextmanager
    def phase(self, bucket: str, only_from: str | None = None):
        """Charge ``bucket`` for the block, then what was charged before (``only_from``: only
        where that was ``only_from``; else the block is charged as before)."""
        if only_from is not None and self._bucket != only_from:
            yield
            return
        prev = self.enter(bucket)
        try:
            yield
        finally:
            self.enter(prev)

    def move(self, src: str, dst: str, seconds: float) -> float:
        """Move up to ``seconds`` already charged to ``src`` over to ``dst``; the seconds moved."""
        _check(src), _check(dst)
        with self._lock:
            self._charge()
            moved = max(0.0, min(float(seconds), self._seconds[src]))
            self._seconds[src] -= moved
            self._seconds[dst] += moved
            return moved

    def end(self) -> None:
        """The run ended: the clock stops."""
        with self._lock:
            if self._ended is None:
                self._charge()
                self._ended = self._since

    def report(self) -> dict:
        """``{"wall_s", "effective_s", "goodput", "seconds": bucket -> s}``, up to now (or the end)."""
        with self._lock:
            if self._ended is None:
                self._charge()
            end = self._ended if self._ended is not None else self._since
            seconds = dict(self._seconds)
        wall = end - self._started
        return {"wall_s": wall, "effective_s": seconds["training"],
                "goodput": seconds["training"] / wall if wall > 0 else None, "seconds": seconds}

    def _charge(self) -> None:
        if self._ended is not None:
            return
        now = self._clock()
        self._seconds[self._bucket] += now - self._since
        self._since = now


def lost_line(report: dict, top: int = 4) -> str:
    """``goodput 93.1% of 412.0 s; lost: restore 10.2 s, redone 8.1 s, ...`` (the largest ``top``)."""
    if not report or report.get("goodput") is None:
        return "goodput: not measured yet"
    lost = sorted(((s, b) for b, s in report["seconds"].items() if b != "training" and s >= 0.005), reverse=True)
    line = f"goodput {report['goodput']:.1%} of {report['wall_s']:.1f} s"
    if lost:
        line += "; lost: " + ", ".join(f"{b} {s:.1f} s" for s, b in lost[:top])
    return line


def _check(bucket: str) -> None:
    if bucket not in BUCKETS:
        raise ValueError(f"unknown goodput bucket {bucket!r}; buckets: {', '.join(BUCKETS)}")

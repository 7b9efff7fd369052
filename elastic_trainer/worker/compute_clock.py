"""A rank's own pace: its compute per step, apart from the time it waits on its peers.

A synchronous step runs at the pace of its slowest rank, so a step's wall
time says nothing of which rank is slow: every rank waits for the same
straggler. What a rank itself spends is its forward and backward passes
(the pipeline schedule's ``forward_one_chunk`` / ``backward_one_chunk`` of
each of its stages, the loss) and its optimizer update; the rest of its step
is waiting (pipeline receives, collectives, the data). Each piece is timed
with the clock of the rank's device (``comm.timing``: CUDA events on a GPU),
read once at the end of the step.

A test hook makes a straggler: with ``slow_factor`` F > 1 each timed piece is
followed by a sleep of (F - 1) times its own duration, so the rank's compute
takes F times as long, as a slower GPU or a throttled host would.

Besides the sums, ``pass_shape`` prices the step's passes at each timed
function's *steady* cost per call: the median of its calls but the first and
the last, times its calls. The first micro-batch of a step runs measurably
slower (cold caches; 20-30% for the demo on a CPU) and the last backward
launches the gradient buckets still waiting: costs per step that a plain sum
would spread over however many micro-batches the rank ran, so a rank given
fewer (balancing) would look slower per micro-batch than it is.

It also gives what pricing at another count needs: the passes' sum, the
first and last calls' sum, the steady cost per call (from three calls up)
and the calls. On one or two calls there is no steady cost to read; the
controller takes it from the peers' ratio of ends to steady
(``controller.compute_at_equal_share``).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from functools import wraps

import torch

from ..comm.timing import start_timer

KINDS = ("forward", "backward", "optimizer")


class ComputeClock:
    """Sums the timed pieces of one step by kind (``forward``, ``backward``, ``optimizer``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slow_factor = 1.0
        self._timers: list[tuple[str, object]] = []
        self._calls: list[tuple[int, object]] = []  # (timed function, timer) of the passes
        self._ids = itertools.count()

    def begin_step(self) -> None:
        self._calls = []
        self._timers = []

    def timed(self, kind: str, fn: Callable) -> Callable:
        """``fn`` timed as ``kind`` each time it is called (and slowed by ``slow_factor``)."""
        if kind not in KINDS:
            raise ValueError(f"unknown compute kind {kind!r}; valid: {', '.join(KINDS)}")
        source = next(self._ids)

        @wraps(fn)
        def run(*args, **kwargs):
            timer = start_timer(self.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.slow_factor > 1.0:
                # Inside the timed span: the slowdown is this rank's own compute, as a slower
                # device's would be (the hook is for CPU runs, where host time is the work's).
                time.sleep((self.slow_factor - 1.0) * (time.perf_counter() - t0))
            timer.stop()
            self._timers.append((kind, timer))
            self._calls.append((source, timer))
            return out
        return run

    def add(self, kind: str, timer) -> None:
        """Count an already stopped timer as ``kind``."""
        self._timers.append((kind, timer))

    def totals(self) -> dict[str, float]:
        """Seconds per kind this step (reading CUDA timers waits for their events)."""
        out = dict.fromkeys(KINDS, 0.0)
        for kind, timer in self._timers:
            out[kind] += timer.seconds()
        return out

    def pass_shape(self) -> dict:
        """This step's passes, each timer read once: ``passes_s`` (their sum), ``steady_s``
        (each timed function's calls at its steady cost, the median of its calls but the first
        and last; see the module docstring), ``ends_s`` (each one's first and last call, one
        call counted once), ``mid_s`` (each one's steady cost per call; None unless each has
        three calls) and ``calls`` (the fewest calls of any)."""
        by_source: dict[int, list[float]] = defaultdict(list)
        for source, timer in self._calls:
            by_source[source].append(timer.seconds())
        calls = [len(t) for t in by_source.values()]
        return {"passes_s": sum(sum(t) for t in by_source.values()),
                "steady_s": sum(statistics.median(t[1:-1] if len(t) > 2 else t) * len(t) for t in by_source.values()),
                "ends_s": sum(t[0] + t[-1] if len(t) > 1 else t[0] for t in by_source.values()),
                "mid_s": sum(statistics.median(t[1:-1]) for t in by_source.values()) if calls and min(calls) > 2 else None,
                "calls": min(calls, default=0)}

    def instrument_stage(self, stage) -> None:
        """Time a pipeline stage's chunks (its own instance's methods; the class is untouched)."""
        stage.forward_one_chunk = self.timed("forward", stage.forward_one_chunk)
        stage.backward_one_chunk = self.timed("backward", stage.backward_one_chunk)
        if hasattr(stage, "backward_weight_one_chunk"):
            stage.backward_weight_one_chunk = self.timed("backward", stage.backward_weight_one_chunk)

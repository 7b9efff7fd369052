"""What each rank's step would take on the equal share of micro-batches: how a rank that
balancing gave fewer keeps the pace it has, and one that recovered shows it.

A step's passes are not n times one steady call: the first call of each timed
function runs cold, and the last backward launches the gradient buckets still
waiting (``worker.compute_clock``). Priced at the equal count ``q``, a rank
that ran ``n`` calls takes its passes as run plus ``q - n`` steady calls.

From three calls up the steady cost is read off the middle calls. On one or
two there are only ends to read, and scaling them by ``q / n`` prices the
fixed costs ``q / n`` times: a recovered rank on 2 of 8 micro-batches read
1.8x slow for the rest of a run, and its shares never came back (seen in
the straggler test on a loaded host). Its steady cost is then its ends over
the ratio of ends to steady cost that its stage's peers show at the same step
(the same work, read the same way), or the last ratio seen for that stage.
A slowdown scales both, so the ratio holds for a slow rank too.
"""

from __future__ import annotations

import statistics


class EqualShare:
    """Prices each rank's passes at the equal share (see the module docstring)."""

    def __init__(self):
        self._ratio: dict[int, float] = {}   # stage -> last ends / steady ratio its ranks showed

    def reset(self) -> None:
        """A new plan: stages hold other blocks, their ratios go."""
        self._ratio.clear()

    def compute(self, results: list[dict], stage_of: dict[int, int], equal: int) -> dict[int, float]:
        """Rank -> its step's compute on ``equal`` micro-batches: passes so priced plus its
        update. ``results``: the step's results (``rank``, ``micro_batches``, ``optimizer_s``,
        ``passes_shape``; without a shape, ``passes_steady_s`` scaled by ``equal / n``)."""
        by_stage: dict[int, list[float]] = {}
        for o in results:
            shape = o.get("passes_shape")
            if shape and shape.get("mid_s") and shape["calls"] > 2:
                by_stage.setdefault(stage_of.get(o["rank"], 0), []).append(shape["ends_s"] / shape["mid_s"])
        for stage, ratios in by_stage.items():
            self._ratio[stage] = statistics.median(ratios)
        return {o["rank"]: self._passes(o, self._ratio.get(stage_of.get(o["rank"], 0)), equal)
                + o.get("optimizer_s", 0.0) for o in results}

    @staticmethod
    def _passes(o: dict, ratio: float | None, equal: int) -> float:
        shape = o.get("passes_shape")
        n = o.get("micro_batches") or equal
        steady = None
        if shape and shape["calls"] > 0:
            n = shape["calls"]
            if n == equal:
                return shape["passes_s"]
            if shape.get("mid_s") and n > 2:
                steady = shape["mid_s"]
            elif ratio is not None and n == 2:
                steady = shape["ends_s"] / ratio
            elif ratio is not None and n == 1 and ratio > 1.5:
                # One call is first and last at once: its cost is the ends' less one steady call.
                steady = shape["ends_s"] / (ratio - 1)
            if steady is not None:
                return shape["passes_s"] + (equal - n) * steady
        passes = o.get("passes_steady_s", o.get("forward_s", 0.0) + o.get("backward_s", 0.0))
        return passes * equal / n

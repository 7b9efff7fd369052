"""Re-cutting a pipeline's stages around a slow rank, by the planner's own per-block costs.

The planner cuts stages to balance parameters (``parallel.partition``) and
prices a rank's compute from its blocks (:func:`planner.predict_candidates`:
FLOPs per parameter and token, a fixed cost per block and micro-batch, and the
optimizer per parameter). Here the same terms give each block's cost, and a
stage's measured compute over its blocks' cost gives that stage's *pace*:
seconds per unit of modelled work. A rank at twice the pace of the others
should hold about half the work.

The new cut minimises the slowest stage, ``max_s pace_s * cost(blocks_s)``,
over contiguous cuts (exact dynamic programming, as for the balanced cut). A
pipeline step runs at its slowest stage, so the prediction scales the step's
compute part (the planner row's ``compute_s`` share of ``total_s``) by the
ratio of the slowest stage before and after, calibrated by the step measured
now. It is proposed only where the gain, over ``payback_steps`` steps,
exceeds what the two live re-plans cost (there and back, once the rank
recovers).

Pure: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def block_costs(param_counts: Sequence[int], tokens: int, micro_batches: int, rate: float, block_cost_s: float,
                optimizer_s_per_param: float) -> list[float]:
    """Each block's modelled compute seconds per step on one rank, in the planner's terms:
    ``6 * params * tokens / rate`` for forward and backward, ``block_cost_s`` per micro-batch,
    and the optimizer's ``params * optimizer_s_per_param``."""
    if rate <= 0 or tokens <= 0 or micro_batches <= 0:
        raise ValueError(f"rate, tokens and micro_batches must be > 0; got {rate}, {tokens}, {micro_batches}")
    return [6 * p * tokens / rate + micro_batches * block_cost_s + p * optimizer_s_per_param for p in param_counts]


def stage_work(costs: Sequence[float], bounds: Sequence[Sequence[int]]) -> list[float]:
    """The modelled work of each stage of ``bounds`` (``[start, end)`` blocks)."""
    return [sum(costs[a:b]) for a, b in bounds]


def stage_paces(compute_s: Sequence[float], costs: Sequence[float], bounds: Sequence[Sequence[int]]) -> list[float]:
    """Each stage's measured compute over its modelled work: seconds per unit of work."""
    if len(compute_s) != len(bounds):
        raise ValueError(f"{len(compute_s)} stage time(s) given for {len(bounds)} stages: one per stage")
    return [c / w if w > 0 else 0.0 for c, w in zip(compute_s, stage_work(costs, bounds))]


def cut_for_paces(costs: Sequence[float], paces: Sequence[float]) -> list[tuple[int, int]]:
    """The contiguous cut of the blocks into ``len(paces)`` non-empty stages that minimises the
    slowest stage, ``max_s paces[s] * work(stage s)``; among the cuts that do, the one whose
    stages are most even (least sum of squared stage times). Exact dynamic programming, twice:
    once for the slowest stage, then for the sum under that bound; ties go to the cut with the
    earlier boundaries."""
    n, k = len(costs), len(paces)
    if k < 1 or n < k:
        raise ValueError(f"cannot cut {n} blocks into {k} non-empty stages")
    if any(p <= 0 for p in paces):
        raise ValueError(f"stage paces must be > 0; got {list(paces)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + max(float(c), 0.0))

    def solve(combine, bound: float) -> tuple[float, list[tuple[int, int]]]:
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(k + 1)]
        cut = [[0] * (n + 1) for _ in range(k + 1)]
        best[0][0] = 0.0
        for s in range(1, k + 1):
            for i in range(s, n - (k - s) + 1):
                for j in range(s - 1, i):
                    t = paces[s - 1] * (prefix[i] - prefix[j])
                    if t > bound:
                        continue
                    v = combine(best[s - 1][j], t)
                    if v < best[s][i] - 1e-15 * max(1.0, abs(v)):
                        best[s][i], cut[s][i] = v, j
        bounds, i = [], n
        for s in range(k, 0, -1):
            j = cut[s][i]
            bounds.append((j, i))
            i = j
        return best[k][n], bounds[::-1]

    slowest, _ = solve(max, float("inf"))
    _, bounds = solve(lambda acc, t: acc + t * t, slowest * (1 + 1e-9))
    return bounds


def slowest_stage_s(costs: Sequence[float], paces: Sequence[float], bounds: Sequence[Sequence[int]]) -> float:
    return max(p * w for p, w in zip(paces, stage_work(costs, bounds)))


@dataclass(frozen=True)
class Recut:
    """A re-cut the cost model says repays itself, and its figures."""

    bounds: list[tuple[int, int]]
    predicted_now_s: float      # the step time measured now
    predicted_s: float          # calibrated: the step time on the new cut
    cost_s: float               # the two re-plans it takes, there and back
    payback_steps: float

    def figures(self) -> dict:
        return {"stages": [list(b) for b in self.bounds], "predicted_step_s": round(self.predicted_s, 6),
                "step_s_before": round(self.predicted_now_s, 6), "cost_s": round(self.cost_s, 6),
                "payback_steps": round(self.payback_steps, 2)}


def propose_recut(costs: Sequence[float], bounds: Sequence[Sequence[int]], paces: Sequence[float],
                  compute_share: float, measured_step_s: float, payback_steps: int, cost_s: float,
                  min_gain: float = 0.0) -> Recut | None:
    """The cut of ``costs`` for stage ``paces``, if it repays ``cost_s`` within ``payback_steps``
    steps from the current ``bounds`` and saves at least ``min_gain`` of the step; else None.
    ``compute_share``: the part of the step that is the pipeline's compute (the planner row's
    ``compute_s / total_s``), which the slowest stage scales; the rest (exposed communication,
    overhead) stays."""
    now = [tuple(b) for b in bounds]
    new = cut_for_paces(costs, paces)
    if new == now:
        return None
    before, after = slowest_stage_s(costs, paces, now), slowest_stage_s(costs, paces, new)
    if before <= 0:
        return None
    share = min(max(compute_share, 0.0), 1.0)
    predicted = measured_step_s * ((1 - share) + share * after / before)
    gain = measured_step_s - predicted
    if gain <= 0 or gain * payback_steps <= cost_s or gain < min_gain * measured_step_s:
        return None
    return Recut(new, measured_step_s, predicted, cost_s, cost_s / gain)

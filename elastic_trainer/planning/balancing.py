"""What rebalancing around a slow rank is worth, by the planner's own step-time model.

A planner row (:func:`planner.predict_candidates`) prices a layout with every
rank at the same speed and every replica running ``micro_batches``. Here the
same terms are re-priced under what the run measured: each replica's
*pace* (its slowest rank's compute per micro-batch over the fastest
replica's) and a *share* of the global batch's micro-batches per replica:

    replica i:  pace_i * (fwd_bwd_s * n_i / m * bubble(n_i) + optimizer_s) + overhead_s
    step:       max over replicas + exposed_comm_s

(the DP all-reduce waits for the last replica, so the slowest one sets the
step). The row's absolute figures come from constants that may be another
machine's, so a prediction is calibrated by the step time measured now: the
gain of a change is ``measured / predicted(now) * (predicted(now) -
predicted(after))``. A change is proposed only when that gain, over
``payback_steps`` steps, exceeds what taking it costs.

Pure: no Ray, no torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from .planner import pipeline_bubble


def share_quantum(pp: int, schedule: str, equal: int) -> tuple[int, int]:
    """(fewest micro-batches a replica may run, the step its count moves in) for a pipeline of
    ``pp`` stages whose equal share is ``equal``: 1F1B needs at least as many micro-batches as
    stages, and the interleaved schedule a multiple of them. A replica keeps two at least
    (where it had two): a rank's pace is read from its calls after the first
    (``compute_clock.pass_shape``), which one micro-batch does not have."""
    if pp == 1:
        return min(2, equal), 1
    return pp, pp if schedule == "interleaved" else 1


def share_micro_batches(costs: Sequence[float], total: int, minimum: int = 1, quantum: int = 1) -> list[int] | None:
    """Micro-batches per replica summing to ``total`` (each at least ``minimum``, in steps of
    ``quantum``) that minimise the slowest replica's time, ``max(n_i * costs[i])``; None when
    ``total`` cannot be so divided. Greedy, one quantum at a time to the replica that would
    finish it soonest, which is optimal for this min-max."""
    k = len(costs)
    if k == 0 or any(c <= 0 for c in costs):
        raise ValueError(f"costs must be positive, one per replica; got {list(costs)}")
    if minimum % quantum or total % quantum or total < k * minimum:
        return None
    shares = [minimum] * k
    heap = [((minimum + quantum) * c, i) for i, c in enumerate(costs)]
    heapq.heapify(heap)
    for _ in range((total - k * minimum) // quantum):
        _, i = heapq.heappop(heap)
        shares[i] += quantum
        heapq.heappush(heap, ((shares[i] + quantum) * costs[i], i))
    return shares


def replica_s(row: dict, micro_batches: int, pace: float) -> float:
    """One replica's predicted compute for ``micro_batches`` at ``pace`` on the layout of ``row``."""
    m = row["micro_batches"]
    passes = row["fwd_bwd_s"] * micro_batches / m * pipeline_bubble(row["schedule"], micro_batches, row["pp"],
                                                                   row.get("virtual", 1))
    return pace * (passes + row["optimizer_s"]) + row["overhead_s"]


def predict_step_s(row: dict, paces: Sequence[float], shares: Sequence[int] | None = None) -> float:
    """Predicted step time of ``row``'s layout with replica ``i`` at ``paces[i]`` running
    ``shares[i]`` micro-batches (default: the row's equal shares)."""
    if len(paces) != row["dp"]:
        raise ValueError(f"{len(paces)} pace(s) given for dp={row['dp']}: one per replica")
    shares = list(shares) if shares is not None else [row["micro_batches"]] * row["dp"]
    return max(replica_s(row, n, p) for n, p in zip(shares, paces)) + row["exposed_comm_s"]


@dataclass(frozen=True)
class Proposal:
    """A change the cost model says repays itself: its shares (None: the equal ones), and the figures."""

    shares: list[int] | None
    predicted_now_s: float      # calibrated: the step time measured now
    predicted_s: float          # calibrated: the step time after the change
    cost_s: float               # what taking the change costs, once
    payback_steps: float        # steps until the gain has repaid the cost

    @property
    def gain_s(self) -> float:
        return self.predicted_now_s - self.predicted_s

    def figures(self) -> dict:
        return {"shares": self.shares, "predicted_step_s": round(self.predicted_s, 6),
                "step_s_before": round(self.predicted_now_s, 6), "cost_s": round(self.cost_s, 6),
                "payback_steps": round(self.payback_steps, 2)}


def propose_shares(row: dict, paces: Sequence[float], current: Sequence[int] | None, measured_step_s: float,
                   payback_steps: int, cost_s: float) -> Proposal | None:
    """The shares that minimise the predicted step under ``paces``, if moving to them from
    ``current`` (None: equal shares) saves more than ``cost_s`` within ``payback_steps``
    steps; else None. ``measured_step_s``: the step time measured under ``current``."""
    dp, m = row["dp"], row["micro_batches"]
    minimum, quantum = share_quantum(row["pp"], row["schedule"], m)
    best = share_micro_batches(paces, dp * m, minimum, quantum)
    if best is None:
        return None
    equal = [m] * dp
    now = list(current) if current is not None else equal
    if best == now:
        return None
    predicted_now = predict_step_s(row, paces, now)
    scale = measured_step_s / predicted_now if predicted_now > 0 else 1.0
    after = scale * predict_step_s(row, paces, best)
    gain = measured_step_s - after
    if gain <= 0 or gain * payback_steps <= cost_s:
        return None
    return Proposal(None if best == equal else best, measured_step_s, after, cost_s, cost_s / gain)

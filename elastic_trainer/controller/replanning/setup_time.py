"""How long a plan's set-up may take: a fixed part for the groups, and a part that grows with the bytes.

A rank's set-up joins its groups (bounded by ``failure.rendezvous_timeout_s``)
and builds, reads or fetches its stage, which takes time in proportion to its
bytes: its parameters to build from the seed or read from ``init_from``, and
parameters with their two AdamW moments to fetch and load at a restore. The
bound is the rendezvous's, plus 30 s, plus the largest rank's bytes at a
rate: the slowest rank's measured at the run's last set-up (halved, to
leave room for a busier one), else a conservative 50 MB/s. Past the bound a
set-up that still makes progress is waited on (``workers.get_all``).
"""

from __future__ import annotations

from ...parallel.partition import blocks_for_rank
from ...planning.plan import Plan

DEFAULT_BYTES_PER_S = 50e6
FIXED_S = 30.0
_STATE_BYTES = 16   # fp32 parameter and its two AdamW moments, with the gradient's room


class SetupTime:
    def __init__(self, rendezvous_s: float, stages_per_rank: int):
        self.rendezvous_s = rendezvous_s
        self.virtual = stages_per_rank
        self.bytes_per_s: float | None = None   # measured at the last set-up

    def largest_rank_bytes(self, plan: Plan, param_counts: list[int], restoring: bool) -> int:
        pp = plan.topology.pp
        per_param = _STATE_BYTES if restoring else 4
        return max(per_param * sum(param_counts[b] for b in blocks_for_rank(plan.stage_bounds, r, pp, self.virtual))
                   for r in range(pp))

    def bound_s(self, plan: Plan, param_counts: list[int] | None, restoring: bool) -> float:
        """Seconds the set-up of ``plan`` may take (``param_counts``: per block; None: unknown)."""
        if not param_counts:
            return self.rendezvous_s + FIXED_S
        rate = self.bytes_per_s / 2 if self.bytes_per_s else DEFAULT_BYTES_PER_S
        return self.rendezvous_s + FIXED_S + self.largest_rank_bytes(plan, param_counts, restoring) / rate

    def measured(self, outs: dict[int, dict]) -> None:
        """Take the rate of a set-up's answers (rank -> ``setup`` answer): the slowest rank's
        bytes built, fetched and loaded over the seconds those took."""
        rates = []
        for o in outs.values():
            t = o.get("timings", {})
            secs = t.get("build", 0.0) + t.get("fetch", 0.0) + t.get("load", 0.0)
            nbytes = 4 * o.get("params", 0) + o.get("moved", {}).get("bytes", 0)
            if secs > 0.05 and nbytes > 0:
                rates.append(nbytes / secs)
        if rates:
            self.bytes_per_s = min(rates)

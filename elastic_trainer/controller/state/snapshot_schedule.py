"""When snapshots are taken: every ``checkpoint.memory_every`` steps, or at an interval measured to fit a budget.

With ``memory_every: auto`` the schedule measures what a snapshot costs under
the plan in force and picks the longest-safe interval that keeps snapshots
under ``checkpoint.max_overhead`` of step time, as CheckFreq (FAST'21) tunes
its checkpoint frequency. After every (re)plan:

1. warm-up: ``WARMUP`` periods with a snapshot each (the first steps after a
   set-up are slow, and these snapshots keep the run safe meanwhile);
2. ``SAMPLES`` periods with a snapshot each, then one period without whose
   time is not used (it still carries the last snapshot's copy), then
   ``SAMPLES`` periods without;
3. cost = median(with) - median(without), a snapshot's whole effect on the
   step, whatever hides it (a stall, a copy beside compute, object-store and
   pinning work competing for the same cores); interval = the fewest periods
   with cost / (interval x period time) <= max_overhead.

After a re-plan, where a choice was made under an earlier plan, the
interval is first estimated from it: a snapshot's cost in proportion to the
heaviest rank's state, the period to the planner's predicted step time. An
estimate of 3 or more periods is taken at once and checked against the steps
it runs (no extra snapshot; one step at a time, as a measurement: a lease's
record spreads its time over its steps): ``CYCLES`` snapshot cycles against
the median of the periods that neither take a snapshot nor follow one; cost =
median over cycles of (cycle - its periods x median(clean period)); the
interval is then chosen from that cost as above. A shorter estimate (cheap snapshots, or a slow one to measure
closely) is measured as at the start.

A period is one step, or with local SGD / DiLoCo the ``comm.local_steps``
steps between two meetings of the replicas (a snapshot must hold one model,
so it is taken only where they have just met). A step at which a durable
checkpoint is due always takes a snapshot (the checkpoint is written from it).
"""

from __future__ import annotations

import math
import statistics

from ...config import TrainerConfig
from ...config.runtime import MEETING_SYNCS

WARMUP = 3
SAMPLES = 5
CYCLES = 3


class SnapshotSchedule:
    """Which steps take a snapshot; ``choice`` holds the last interval measured (auto only)."""

    def __init__(self, cfg: TrainerConfig):
        ck, comm = cfg.checkpoint, cfg.comm
        self.cfg = cfg
        self.auto = ck.memory_every == "auto"
        self.unit = comm.local_steps if comm.sync in MEETING_SYNCS else 1
        self.interval = 1 if self.auto else ck.memory_every   # periods (auto) or steps between snapshots
        self.last_taken = 0
        self.choice: dict | None = None
        self._start_period = 0
        self._with: list[float] = []
        self._without: list[float] = []
        self._period_s = 0.0
        self._requested = False
        self._done = False
        self._scale: dict | None = None         # the plan in force's scale (see restart)
        self._choice_scale: dict | None = None  # the scale of the plan ``choice`` was made under
        self._verify: dict | None = None        # checking an estimated interval (see restart)

    def restart(self, step: int, scale=None) -> None:
        """A plan was set up at ``step`` (its state is a snapshot or the seed): measure again.
        ``scale`` ({"snapshot_bytes", "step_s"}: the new plan's heaviest rank's state and its
        predicted step time, or a function returning it, asked only when wanted) lets a choice made
        under an earlier plan estimate the interval, then checked against the steps it runs (see
        the module's doc)."""
        self.last_taken = step
        self._start_period = -(-step // self.unit)
        self._with, self._without, self._period_s = [], [], 0.0
        self._done, self._verify, self._scale = False, None, scale
        if not self.auto:
            return
        self.interval = 1
        before = self._choice_scale
        if self.choice and before and before["snapshot_bytes"] > 0 and before["step_s"] > 0:
            scale = self._scale_now()
        if self.choice and scale and before and before["snapshot_bytes"] > 0 and before["step_s"] > 0:
            cost = self.choice["snapshot_cost_s"] * scale["snapshot_bytes"] / before["snapshot_bytes"]
            period = self.choice["step_s"] * self.unit * scale["step_s"] / before["step_s"]
            k = self._interval_for(cost, period)
            if k >= 3:
                self.interval = k
                self._verify = {"estimate": k, "since": None, "cycle_s": 0.0, "cycles": [], "clean": []}

    def _scale_now(self) -> dict | None:
        if callable(self._scale):
            self._scale = self._scale()
        return self._scale

    def _interval_for(self, cost: float, period_s: float) -> int:
        budget = self.cfg.checkpoint.max_overhead
        return max(1, math.ceil(cost / (budget * period_s) - 1e-9)) if period_s > 0 else 1

    def _phase(self, step: int) -> str:
        """'warmup', 'with', 'gap', 'without' while measuring, 'verify' while checking an estimate
        (auto only), else 'chosen'."""
        k = -(-step // self.unit) - self._start_period  # period of the step, from 1 after the set-up
        if not self.auto:
            return "chosen"
        if self._verify is not None:
            return "verify"
        if self.choice_done:
            return "chosen"
        if k <= WARMUP:
            return "warmup"
        if k <= WARMUP + SAMPLES:
            return "with"
        if k == WARMUP + SAMPLES + 1:
            return "gap"
        return "without"

    @property
    def choice_done(self) -> bool:
        return self._done


    def _meets(self, step: int) -> bool:
        return step % self.unit == 0

    @property
    def requested(self) -> bool:
        """A snapshot was asked for (``request``) and not yet taken."""
        return self._requested

    def request(self) -> None:
        """Take a snapshot at the next step where one can be taken (a re-plan to grow waits for it)."""
        self._requested = True

    def due(self, step: int) -> bool:
        """Whether ``step`` takes a snapshot."""
        if not self._meets(step):
            return False
        if self._requested:
            return True
        durable = self.cfg.checkpoint.durable_every
        if durable and self.cfg.checkpoint.storage and step % durable == 0:
            return True
        if not self.auto:
            return step % self.interval == 0
        phase = self._phase(step)
        if phase in ("warmup", "with"):
            return True
        if phase in ("gap", "without"):
            return False
        return step - self.last_taken >= self.interval * self.unit   # chosen, or an estimate checked

    def taken(self, step: int) -> None:
        self.last_taken = step
        self._requested = False

    def observe(self, step: int, step_s: float, snapshot: bool | None = None) -> dict | None:
        """Count a completed step's time; returns the choice once one is made (auto only).
        ``snapshot``: whether the step took one (None: as ``due`` says, read before ``taken``)."""
        if not self.auto or self.choice_done:
            return None
        phase = self._phase(step)
        self._period_s += step_s
        if not self._meets(step):
            return None
        period_s, self._period_s = self._period_s, 0.0
        if phase == "verify":
            return self._check(step, period_s, self.due(step) if snapshot is None else snapshot)
        if phase == "with":
            self._with.append(period_s)
        elif phase == "without":
            self._without.append(period_s)
        if len(self._without) < SAMPLES:
            return None
        with_s, without_s = statistics.median(self._with), statistics.median(self._without)
        return self._choose(step, max(0.0, with_s - without_s), without_s, snapshots=WARMUP + SAMPLES)

    def _check(self, step: int, period_s: float, snapshot: bool) -> dict | None:
        """A period under an estimated interval: a snapshot's cycle, and the clean periods in it.
        A cycle is closed by the next snapshot, whatever took it (the interval, a durable
        checkpoint, a request), and counted with its length."""
        v = self._verify
        if snapshot:
            if v["since"] is not None and v["since"] >= 1:
                v["cycles"].append((v["cycle_s"], v["since"] + 1))
            v["since"], v["cycle_s"] = 0, period_s
        elif v["since"] is not None:
            v["since"] += 1
            v["cycle_s"] += period_s
            if v["since"] >= 2:   # the period after a snapshot carries its copy
                v["clean"].append(period_s)
        if len(v["cycles"]) < CYCLES or not v["clean"]:
            return None
        clean = statistics.median(v["clean"])
        cost = max(0.0, statistics.median(total - n * clean for total, n in v["cycles"]))
        self._verify = None
        return self._choose(step, cost, clean, snapshots=0, estimated=v["estimate"])

    def _choose(self, step: int, cost: float, period_s: float, snapshots: int, estimated: int | None = None) -> dict:
        budget = self.cfg.checkpoint.max_overhead
        self.interval = self._interval_for(cost, period_s)
        self._done, self._choice_scale = True, self._scale_now()
        self.choice = {
            "step": step, "interval": self.interval * self.unit, "snapshot_cost_s": cost, "step_s": period_s / self.unit,
            "expected_overhead": cost / (self.interval * period_s) if period_s > 0 else 0.0,
            "max_overhead": budget,
            # A failure restores the last committed snapshot: up to one interval of steps is run again,
            # and one more while the newest snapshot is still being pinned.
            "redo_steps": self.interval * self.unit + 1,
            # Snapshots taken only to measure (beyond what the interval takes), and the estimate checked.
            "measuring_snapshots": snapshots, "estimated_interval": None if estimated is None else estimated * self.unit,
        }
        return self.choice

    def describe(self) -> dict:
        """For ``status``: the interval in force, whether it is still being measured, the last choice."""
        return {"mode": "auto" if self.auto else "fixed", "interval": self.interval * self.unit,
                "measuring": self.auto and not self.choice_done, "choice": self.choice}

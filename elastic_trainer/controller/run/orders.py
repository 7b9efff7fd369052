"""A re-plan decided, as a value: recovery (after a failure) and growth (joined workers, a straggler
benched, a re-cut) hand it to the re-plan, which alone carries it out.

It sits below both sides so that failure handling need not import the re-plan that consumes its
orders. The annotations name the step's outcome and the survivors' world by name only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReplanOrder:
    """A re-plan decided: why, since when, and what the failure (if any) left to keep."""

    # death | silent | hang | exception | collective | startup | grow | straggler | recut | drain | anomaly
    # | corruption (a replay to prove who) | quarantine (the move off a proven culprit)
    reason: str
    detected: float                   # perf_counter when the need was found
    failed: StepOutcome | None = None  # the failed step; None for a re-plan between steps or at start-up
    plan_before: dict | None = None   # the plan's description before it, for the event
    cut: tuple | None = None          # a re-cut: keep the layout and every rank's worker, with these stage bounds
    shrunk: ShrunkWorld | None = None  # the world the survivors shrank to, which the next plan may keep
    whole: set = field(default_factory=set)   # the failed plan's groups left whole, which the next plan may carry
    settle_wait: dict = field(default_factory=dict)   # how the settle round's wait ended, for the event
    abort_setups: bool = False        # set-ups of a failed attempt may still wait: abort them first
    cause: str | None = None          # what the failure is known to be due to ("memory")
    failure: int | None = None        # the run's failure number (``Recovery``); None between steps
    rollback: dict | None = None      # an anomaly's rollback: {"anomaly": its fields, "cursor": its batch's start}
    restore_at_most: int | None = None   # restore no later step (corruption: the last every replica agreed on)

    @property
    def after_failure(self) -> bool:
        return self.failed is not None

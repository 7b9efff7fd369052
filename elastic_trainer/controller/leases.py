"""How many steps a lease holds (``control.lease_steps``): where the controller must see a step, it ends.

A lease runs steps on the workers' own, back to back, and the controller acts
only between leases (docs/runtime.md, "Leases"). So a lease ends at the next
snapshot step (its last step takes it), before an evaluation, and at the
run's last step; and some moments take one step at a time (``one_at_a_time``).
"""

from __future__ import annotations

from ..config import TrainerConfig
from .snapshot_schedule import SnapshotSchedule


def lease_length(cfg: TrainerConfig, first: int, schedule: SnapshotSchedule, one_at_a_time: bool) -> int:
    """Steps from ``first`` the workers run on their own: up to the next snapshot step,
    evaluation or the last step, whichever comes first, and at most ``control.lease_steps``.
    One while ``memory_every: auto`` measures what a snapshot costs (its steps with and
    without must be driven alike), and where the caller says so (``one_at_a_time``)."""
    cap = cfg.control.lease_steps
    if cap <= 1 or one_at_a_time or (schedule.auto and not schedule.choice_done):
        return 1
    last = min(cfg.train.steps, first + cap - 1)
    ev = cfg.eval
    if ev.enabled:
        last = min(last, -(-first // ev.every) * ev.every)   # the next evaluation comes after it
    for step in range(first, last):
        if schedule.due(step):
            return step - first + 1
    return last - first + 1

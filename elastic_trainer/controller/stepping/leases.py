"""How many steps a lease holds (``control.lease_steps``): where the controller must see a step, it ends.

A lease runs steps on the workers' own, back to back, and the controller acts
only between leases (docs/runtime.md, "Leases"). So a lease ends at the next
snapshot step (its last step takes it), before an evaluation, and at the
run's last step; and some moments take one step at a time (``one_at_a_time``).
With ``lease_steps: auto`` (the default) a lease also holds no more steps
than fit ``AUTO_LEASE_S`` at the measured step time, so what the controller
decides between leases (balancing, growth, a stop) still lands within about
a second.
"""

from __future__ import annotations

import copy

from ...config import TrainerConfig
from ..state.snapshot_schedule import SnapshotSchedule

# The most wall time an ``auto`` lease is sized for. Long enough that the controller's work per
# lease (a call per rank, 0.7 ms a rank on this host) stays off the critical path while the lease
# runs; short enough that a decision made between leases takes effect a lease (about a second)
# later, and a stop within two (with ``renew_early`` the next lease is already queued).
AUTO_LEASE_S = 1.0


def lease_cap(cfg: TrainerConfig, step_s: float | None) -> int:
    """The most steps a lease may hold: ``control.lease_steps``, or with ``auto`` as many as fit
    ``AUTO_LEASE_S`` at ``step_s`` (the measured step time), and 1 while none is measured."""
    cap = cfg.control.lease_steps
    if cap != "auto":
        return cap
    if step_s is None or step_s <= 0:
        return 1
    return max(1, int(AUTO_LEASE_S / step_s))


def schedule_after(schedule: SnapshotSchedule, snapshot_pending: int | None) -> SnapshotSchedule:
    """``schedule`` as it will be once the snapshot of step ``snapshot_pending`` is recorded: a
    lease granted ahead (``StepLoop._renew``) is sized before the steps of the one it follows
    are, and ``memory_every: auto`` counts its next snapshot step from the last one taken. Read
    from the schedule as it stands, a lease ahead of a snapshot found its first step due at once,
    was one step long, and so none was granted ahead: the ranks waited for every lease."""
    if snapshot_pending is None or snapshot_pending <= schedule.last_taken:
        return schedule
    view = copy.copy(schedule)   # due() only reads; the lists it shares are not written through it
    view.last_taken = snapshot_pending
    return view


def lease_length(cfg: TrainerConfig, first: int, schedule: SnapshotSchedule, one_at_a_time: bool,
                 step_s: float | None = None, snapshot_pending: int | None = None) -> int:
    """Steps from ``first`` the workers run on their own: up to the next snapshot step,
    evaluation or the last step, whichever comes first, and at most ``lease_cap`` (which
    ``step_s``, the measured step time, sets under ``lease_steps: auto``). One while
    ``memory_every: auto`` measures what a snapshot costs (its steps with and without must be
    driven alike, and so must an estimate's after a re-plan: a lease's record spreads its time
    over its steps), and where the caller says so (``one_at_a_time``). ``snapshot_pending``: the step of a snapshot
    granted but not yet recorded (a lease sized ahead, ``schedule_after``)."""
    schedule = schedule_after(schedule, snapshot_pending)
    cap = lease_cap(cfg, step_s)
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

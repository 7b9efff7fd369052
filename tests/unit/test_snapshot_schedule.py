"""memory_every: auto measures a snapshot's cost after each set-up and picks the interval that fits the budget."""

from elastic_trainer.config import TrainerConfig
from elastic_trainer.controller.state.snapshot_schedule import CYCLES, SAMPLES, WARMUP, SnapshotSchedule


def _cfg(**checkpoint):
    raw = {"data": {"path": "/tmp/x"}, "train": {"steps": 100}, "checkpoint": checkpoint}
    return TrainerConfig.model_validate(raw)


def _run(sched, steps, step_s, cost_s, start=0, scale=None):
    """Drive ``sched`` over ``steps`` after a set-up at ``start`` (``scale``: the plan's, see
    ``restart``): a step costs ``step_s``, plus ``cost_s`` when it takes a snapshot. Returns the
    steps that took one and the choice."""
    sched.restart(start, scale)
    taken, choice = [], None
    for step in range(start + 1, start + steps + 1):
        snap = sched.due(step)
        # As the run does (controller.step_loop): the step is observed, then its snapshot recorded.
        choice = sched.observe(step, step_s + (cost_s if snap else 0.0), snapshot=snap) or choice
        if snap:
            taken.append(step)
            sched.taken(step)
    return taken, choice


def test_cheap_snapshots_keep_an_interval_of_one():
    sched = SnapshotSchedule(_cfg())
    taken, choice = _run(sched, 40, 0.1, 0.002)
    measuring = WARMUP + 2 * SAMPLES + 1
    assert choice["interval"] == 1 and choice["step"] == measuring
    assert choice["redo_steps"] == 2 and abs(choice["snapshot_cost_s"] - 0.002) < 1e-9
    # Snapshots while measuring (warm-up and the "with" window), none in the gap and "without"
    # window, then every step.
    assert taken == list(range(1, WARMUP + SAMPLES + 1)) + list(range(measuring + 1, 41))
    assert sched.describe() == {"mode": "auto", "interval": 1, "measuring": False, "choice": choice}


def test_a_slow_snapshot_spreads_out_to_fit_the_budget():
    sched = SnapshotSchedule(_cfg(max_overhead=0.05))
    taken, choice = _run(sched, 60, 0.1, 0.02)   # 20% a step if taken every step
    assert choice["interval"] == 4 and abs(choice["expected_overhead"] - 0.05) < 1e-9
    # The last snapshot was the "with" window's: the next is due at once, then every 4 steps.
    after = [s for s in taken if s > choice["step"]]
    assert after == list(range(choice["step"] + 1, 61, 4))


def test_every_set_up_measures_again():
    sched = SnapshotSchedule(_cfg())
    _run(sched, 40, 0.1, 0.1)
    assert sched.interval > 1
    sched.restart(40)
    assert sched.describe()["measuring"] and sched.interval == 1 and sched.due(41)
    _, choice = _run(sched, 30, 0.1, 0.0, start=40)
    assert choice["interval"] == 1 and choice["step"] == 40 + WARMUP + 2 * SAMPLES + 1


def test_a_fixed_interval_and_durable_steps():
    sched = SnapshotSchedule(_cfg(memory_every=5, durable_every=3, storage="/tmp/ck"))
    taken, choice = _run(sched, 15, 0.1, 0.5)
    assert choice is None and taken == [3, 5, 6, 9, 10, 12, 15]


def test_local_sgd_measures_in_periods_between_meetings():
    raw = {"data": {"path": "/tmp/x"}, "train": {"steps": 200}, "comm": {"sync": "local_sgd", "local_steps": 4}}
    sched = SnapshotSchedule(TrainerConfig.model_validate(raw))
    taken, choice = _run(sched, 120, 0.1, 0.06)  # 0.06 s a snapshot, once per 0.4 s period: 15%
    assert all(s % 4 == 0 for s in taken)
    assert choice["interval"] == 12 and choice["step"] == 4 * (WARMUP + 2 * SAMPLES + 1)


def test_a_replan_estimates_from_the_last_choice_and_checks_it_with_no_extra_snapshot():
    sched = SnapshotSchedule(_cfg(max_overhead=0.05))
    _, first = _run(sched, 60, 0.1, 0.02, scale={"snapshot_bytes": 1000, "step_s": 0.1})
    assert first["interval"] == 4 and first["measuring_snapshots"] == WARMUP + SAMPLES
    # The new plan's heaviest rank holds twice the state, its step predicted as long: the cost is
    # estimated at 0.04 s, so every 8 steps; measured, a snapshot costs 0.06 s: every 12 from then.
    taken, choice = _run(sched, 80, 0.1, 0.06, start=60, scale={"snapshot_bytes": 2000, "step_s": 0.1})
    assert choice["estimated_interval"] == 8 and choice["measuring_snapshots"] == 0
    assert abs(choice["snapshot_cost_s"] - 0.06) < 1e-9 and choice["interval"] == 12
    # CYCLES whole cycles of the estimate, closed by the next snapshot; no other snapshot taken.
    assert choice["step"] == 68 + CYCLES * 8
    assert taken == list(range(68, choice["step"] + 1, 8)) + list(range(choice["step"] + 12, 141, 12))
    # A plan whose step is predicted twice as long halves the interval's estimate.
    sched.restart(140, {"snapshot_bytes": 2000, "step_s": 0.2})
    assert sched.interval == 6 and sched.describe()["measuring"]


def test_an_estimate_is_checked_on_cycles_a_durable_checkpoint_cuts_short():
    # Durable checkpoints every 10 steps take snapshots inside the estimated 12-step cycles: every
    # cycle a snapshot closes counts, with its length.
    sched = SnapshotSchedule(_cfg(max_overhead=0.05, durable_every=10, storage="/tmp/ck"))
    _, first = _run(sched, 60, 0.1, 0.02, scale={"snapshot_bytes": 1000, "step_s": 0.1})
    taken, choice = _run(sched, 80, 0.1, 0.06, start=60, scale={"snapshot_bytes": 2000, "step_s": 0.1})
    assert choice is not None and choice["estimated_interval"] is not None
    assert abs(choice["snapshot_cost_s"] - 0.06) < 1e-9 and choice["measuring_snapshots"] == 0


def test_a_short_estimate_or_none_measures_as_at_the_start():
    sched = SnapshotSchedule(_cfg(max_overhead=0.05))
    _run(sched, 60, 0.1, 0.02, scale={"snapshot_bytes": 1000, "step_s": 0.1})
    sched.restart(60, {"snapshot_bytes": 250, "step_s": 0.1})   # estimate: 1 step; measured closely
    assert sched.interval == 1 and sched._phase(61) == "warmup"
    sched.restart(60)                                             # no scale: measured
    assert sched._phase(61) == "warmup"

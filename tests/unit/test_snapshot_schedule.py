"""memory_every: auto measures a snapshot's cost after each set-up and picks the interval that fits the budget."""

from elastic_trainer.config import TrainerConfig
from elastic_trainer.controller.snapshot_schedule import SAMPLES, WARMUP, SnapshotSchedule


def _cfg(**checkpoint):
    raw = {"data": {"path": "/tmp/x"}, "train": {"steps": 100}, "checkpoint": checkpoint}
    return TrainerConfig.model_validate(raw)


def _run(sched, steps, step_s, cost_s, start=0):
    """Drive ``sched`` over ``steps`` after a set-up at ``start``: a step costs ``step_s``, plus
    ``cost_s`` when it takes a snapshot. Returns the steps that took one and the choice."""
    sched.restart(start)
    taken, choice = [], None
    for step in range(start + 1, start + steps + 1):
        snap = sched.due(step)
        if snap:
            taken.append(step)
            sched.taken(step)
        choice = sched.observe(step, step_s + (cost_s if snap else 0.0)) or choice
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

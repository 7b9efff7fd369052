"""Where a lease ends: the next snapshot step, an evaluation, the last step; one step where it must;
with ``lease_steps: auto`` (the default) as many steps as fit about a second at the measured step time."""

from types import SimpleNamespace

import pytest

from elastic_trainer.config import TrainerConfig
from elastic_trainer.controller.stepping.leases import AUTO_LEASE_S
from elastic_trainer.controller.state.snapshot_schedule import SnapshotSchedule
from elastic_trainer.controller.step_loop import StepLoop
from elastic_trainer.controller.stepping.one_step import StepDriver
from elastic_trainer.errors import ConfigError

from ..conftest import tiny_config


def _ctl(steps=40, lease=16, memory_every=8, warm=10, step_s=0.01, **sections):
    control = {} if lease is None else {"lease_steps": lease}
    cfg = TrainerConfig.from_dict(tiny_config("/nonexistent", train={"steps": steps}, control=control,
                                              checkpoint={"memory_every": memory_every}, **sections))
    driver = StepDriver(cfg)
    # ``warm`` steps recorded since the set-up, each taking ``step_s`` (None: none measured yet).
    if step_s is not None:
        driver.step_times.extend([step_s] * warm)
    driver.steps_since_setup = warm
    return SimpleNamespace(cfg=cfg, ps=None, _error_at=None, schedule=SnapshotSchedule(cfg),
                           growth=SimpleNamespace(replan_pending=lambda: False,
                                                  drains=SimpleNamespace(losing=lambda: False)), driver=driver)


def _loop(ctl) -> StepLoop:
    # The loop with the parts lease_at reads: the run's armed fault, the driver, the schedule,
    # growth's pending re-plan, the parameter server.
    return StepLoop(ctl.cfg, SimpleNamespace(error_at=ctl._error_at), None, ctl.driver, None, None, None,
                    ctl.schedule, None, ctl.growth, None, None, None, lambda: ctl.ps)


def lease(ctl, first):
    # What the controller's loop asks, from its state.
    return _loop(ctl).lease_at(first)


def test_a_lease_runs_up_to_the_next_snapshot_step_and_the_last_step():
    ctl = _ctl()
    assert [lease(ctl, s) for s in (1, 4, 8, 9, 33)] == [8, 5, 1, 8, 8]
    assert lease(_ctl(steps=37), 33) == 5            # the run's last step ends it
    assert lease(_ctl(lease=3), 1) == 3               # control.lease_steps caps it
    assert lease(_ctl(lease=1), 1) == 1


def test_an_evaluation_ends_a_lease():
    ctl = _ctl(memory_every=100, eval={"every": 5, "fraction": 0.1})
    assert [lease(ctl, s) for s in (1, 5, 6)] == [5, 1, 5]


def test_one_step_at_a_time_where_the_controller_must_see_each():
    for cap in (16, "auto"):
        ctl = _ctl(warm=2, lease=cap)
        assert lease(ctl, 1) == 1                      # warm-up: its step times set the timeouts
        ctl = _ctl(lease=cap)
        ctl.growth = SimpleNamespace(replan_pending=lambda: True, drains=SimpleNamespace(losing=lambda: False))
        assert lease(ctl, 1) == 1                      # a re-plan waits for its snapshot step
        ctl = _ctl(lease=cap)
        ctl.growth = SimpleNamespace(replan_pending=lambda: False, drains=SimpleNamespace(losing=lambda: True))
        assert lease(ctl, 1) == 1                      # a node given too short a notice has yet to go
        ctl = _ctl(lease=cap)
        ctl.ps = object()
        assert lease(ctl, 1) == 1                      # a parameter server keeps per-step state
        ctl = _ctl(lease=cap)
        ctl.schedule.request()
        assert lease(ctl, 1) == 1                      # a snapshot asked for comes at once


def test_auto_is_the_default_and_a_lease_holds_about_a_second_of_steps():
    assert TrainerConfig.from_dict(tiny_config("/nonexistent")).control.lease_steps == "auto"
    far = dict(steps=400, memory_every=200, lease=None)
    per = lambda step_s: lease(_ctl(step_s=step_s, **far), 11)   # noqa: E731
    assert AUTO_LEASE_S == 1.0
    assert [per(s) for s in (0.1, 0.25, 0.3, 0.5, 0.6, 2.0)] == [10, 4, 3, 2, 1, 1]
    assert per(0.001) == 190                           # fast steps: up to the next snapshot step (200)
    # Still where the controller must see a step: a snapshot step, an evaluation, the last step.
    ctl = _ctl(lease=None, step_s=0.001)
    assert [lease(ctl, s) for s in (1, 4, 8, 9, 33)] == [8, 5, 1, 8, 8]
    ctl = _ctl(lease=None, step_s=0.001, memory_every=100, eval={"every": 5, "fraction": 0.1})
    assert [lease(ctl, s) for s in (1, 5, 6)] == [5, 1, 5]


def test_auto_drives_step_by_step_until_a_step_time_is_measured():
    assert lease(_ctl(lease="auto", warm=0, step_s=None), 1) == 1
    # Past the warm-up count but no step recorded (an evaluation only, say): still one.
    assert lease(_ctl(lease="auto", warm=10, step_s=None), 11) == 1
    assert lease(_ctl(lease="auto", warm=10, step_s=0.1), 11) == 6   # measured: up to the snapshot step, 16


def test_a_number_caps_a_lease_whatever_the_step_time():
    assert lease(_ctl(lease=16, step_s=2.0), 1) == 8
    assert lease(_ctl(lease=1, step_s=0.001), 1) == 1


def test_auto_reads_the_step_time_under_the_plan_in_force():
    ctl = _ctl(lease="auto", steps=400, memory_every=200, warm=20, step_s=0.5)
    assert lease(ctl, 21) == 2
    # A re-plan onto faster workers: the steps before it no longer count, once one is recorded.
    ctl.driver.steps_since_setup = 0
    assert ctl.driver.median_step_s() is None and lease(ctl, 21) == 1
    ctl.driver.step_times.extend([0.05] * 4)
    ctl.driver.steps_since_setup = 4
    assert ctl.driver.median_step_s() == 0.05 and lease(ctl, 25) == 20


@pytest.mark.parametrize("value", [0, -3, "fast", True, 2.5])
def test_lease_steps_takes_a_number_or_auto(value):
    with pytest.raises(ConfigError, match=r"control.lease_steps"):
        TrainerConfig.from_dict(tiny_config("/nonexistent", control={"lease_steps": value}))


def test_lease_steps_overrides_read_numbers_and_auto():
    cfg = TrainerConfig.from_dict(tiny_config("/nonexistent"))
    assert cfg.with_overrides(["control.lease_steps=1"]).control.lease_steps == 1
    assert cfg.with_overrides(["control.lease_steps=24"]).control.lease_steps == 24
    assert cfg.with_overrides(["control.lease_steps=auto"]).control.lease_steps == "auto"


def test_a_lease_granted_ahead_of_an_unrecorded_snapshot_counts_the_next_from_it():
    # memory_every auto (the default) counts its next snapshot step from the last one taken. A
    # lease granted while the one before it runs (control.renew_early) is sized before that
    # one's snapshot is recorded; counted from the snapshot before, its first step was due at
    # once, the lease one step long, none was granted ahead, and the ranks waited for each lease.
    ctl = _ctl(steps=100, memory_every="auto", lease="auto", warm=20, step_s=0.01)
    schedule = ctl.schedule
    for step in range(1, 15):   # the measurement: snapshots 1..8, none 9..14
        if schedule.due(step):
            schedule.taken(step)
        schedule.observe(step, 0.012 if step <= 8 else 0.010)
    assert schedule.choice["interval"] == 4 and schedule.last_taken == 8
    loop = _loop(ctl)
    assert loop.lease_at(15) == 1                       # 15 is due: 7 steps past the last
    schedule.taken(15)
    assert loop.lease_at(16) == 4                       # 16..19, its last step takes a snapshot
    # Granted ahead of 16..19's steps being recorded: 20..23, the snapshot at 23.
    assert loop.lease_at(20, snapshot_pending=19) == 4
    schedule.taken(19)
    assert loop.lease_at(20) == 4                       # as it is once 19 is recorded

"""Where a lease ends: the next snapshot step, an evaluation, the last step; one step where it must."""

from types import SimpleNamespace

from elastic_trainer.config import TrainerConfig
from elastic_trainer.controller.leases import lease_length
from elastic_trainer.controller.snapshot_schedule import SnapshotSchedule
from elastic_trainer.controller.step_loop import StepLoop

from ..conftest import tiny_config


def _ctl(steps=40, lease=16, memory_every=8, warm=10, **sections):
    cfg = TrainerConfig.from_dict(tiny_config("/nonexistent", train={"steps": steps}, control={"lease_steps": lease},
                                              checkpoint={"memory_every": memory_every}, **sections))
    return SimpleNamespace(cfg=cfg, ps=None, _error_at=None, schedule=SnapshotSchedule(cfg),
                           recovery=SimpleNamespace(replan_pending=lambda: False),
                           driver=SimpleNamespace(steps_since_setup=warm))


def lease(ctl, first):
    # What the controller's loop asks, from its state.
    return lease_length(ctl.cfg, first, ctl.schedule, StepLoop(ctl).one_step_at_a_time())


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
    ctl = _ctl(warm=2)
    assert lease(ctl, 1) == 1                          # warm-up: its step times set the timeouts
    ctl = _ctl()
    ctl.recovery = SimpleNamespace(replan_pending=lambda: True)
    assert lease(ctl, 1) == 1                          # a re-plan waits for its snapshot step
    ctl = _ctl()
    ctl.ps = object()
    assert lease(ctl, 1) == 1                          # a parameter server keeps per-step state
    ctl = _ctl()
    ctl.schedule.request()
    assert lease(ctl, 1) == 1                          # a snapshot asked for comes at once

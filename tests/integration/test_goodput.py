"""Goodput on a real run (controller.run.goodput): a worker killed mid-run and its recovery's
restore held for a known pause; the buckets add up to the run's wall time as its own events
time it, and the pause, the failed step and the steps run again each land in their bucket."""

import threading
import time

import pytest
import ray

from elastic_trainer import Trainer, TrainerConfig
from elastic_trainer.chaos.simulate import kill_pids

from ..conftest import tiny_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PAUSE_S = 2.0   # the injected pause: the recovery's restore is held this long


def _config(corpus: str) -> TrainerConfig:
    return TrainerConfig.from_dict(tiny_config(
        corpus, run={"name": "goodput"}, train={"steps": 24}, parallel={"dp": 2, "pp": 2},
        checkpoint={"memory_every": 2},
        failure={"allow_fault_injection": True, "min_step_timeout_s": 3, "rendezvous_timeout_s": 10}))


class _Driver:
    """Holds the run where it is armed: kills rank 1's worker in a step, then holds the restore
    of its recovery for ``PAUSE_S`` and reads the status there."""

    def __init__(self):
        self.ctl = None
        self.seen: dict = {}
        self.thread = threading.Thread(target=self._drive, daemon=True)

    def on_start(self, controller) -> None:
        self.ctl = controller
        ray.get(controller.fault_point.remote("arm", "in_step", 4))
        self.thread.start()

    def _held(self) -> dict:
        while True:
            held = ray.get(self.ctl.fault_point.remote("held"))
            if held:
                return held
            time.sleep(0.02)

    def _drive(self) -> None:
        held = self._held()
        st = ray.get(self.ctl.status.remote())
        victim = next(w for w in st["workers"] if w["rank"] == 1)
        self.seen["killed_in_step"] = held["step"]
        ray.get(self.ctl.fault_point.remote("arm", "restore", 1))
        kill_pids([victim["pid"]])
        ray.get(self.ctl.fault_point.remote("release"))
        self._held()
        time.sleep(PAUSE_S)   # the pause itself
        self.seen["status"] = ray.get(self.ctl.status.remote())
        ray.get(self.ctl.fault_point.remote("release"))


def test_the_buckets_add_up_to_the_wall_time_and_a_held_restore_shows_in_restore(cluster, corpus_dir):
    driver = _Driver()
    result = Trainer(_config(corpus_dir), verbose=False, on_start=driver.on_start).fit()
    driver.thread.join(30)
    assert result.finished and result.recoveries, result.events
    g = result.goodput
    seconds = g["seconds"]
    # By the run's own events: from its placement's start to its last state.
    states = [e for e in result.events if e["kind"] == "state"]
    wall = states[-1]["time"] - states[0]["time"]
    assert sum(seconds.values()) == pytest.approx(g["wall_s"], rel=1e-9)
    assert g["wall_s"] == pytest.approx(wall, rel=0.01), (g, wall)
    assert all(s >= 0 for s in seconds.values()), seconds
    # The held restore is in restore, and status showed it while the run held there.
    assert seconds["restore"] >= PAUSE_S, seconds
    assert driver.seen["status"]["goodput"]["seconds"]["restore"] >= PAUSE_S
    # The failed step until its failure was known, and the steps the rollback ran again.
    [death] = [e for e in result.recoveries if e["reason"] != "grow"]
    assert seconds["detection"] > 0, seconds
    assert (seconds["redone"] > 0) == (death["steps_rolled_back"] > 0), (seconds, death)
    assert seconds["startup"] > 0 and 0 < g["goodput"] < 1 and g["effective_s"] == seconds["training"]

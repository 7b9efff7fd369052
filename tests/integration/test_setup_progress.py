"""A set-up past its time is waited on while it makes progress, and ended when it stops."""

import time

import pytest
import ray

from elastic_trainer.errors import WorkerError
from elastic_trainer.controller.run.asking import get_all

pytestmark = pytest.mark.integration


@ray.remote(num_cpus=0)
def _slow(seconds: float) -> str:
    time.sleep(seconds)
    return "done"


@pytest.mark.timeout(120)
def test_a_slow_set_up_that_moves_is_waited_on_and_a_stuck_one_ends(cluster):
    counts = {"n": 0}

    def moving(wids):
        counts["n"] += 1
        return {w: (counts["n"], 0) for w in wids}

    # 1 s allowed, 3 s taken: each look past the bound sees the count move, so the wait goes on.
    assert get_all({0: _slow.remote(3.0)}, {0: 7}, 1.0, "set up", progress=moving) == {0: "done"}
    assert counts["n"] >= 3
    with pytest.raises(WorkerError, match=r"worker 7: .*no answer in 1s"):
        get_all({0: _slow.remote(30.0)}, {0: 7}, 1.0, "set up", progress=lambda wids: {w: (5, 0) for w in wids})
    with pytest.raises(WorkerError, match=r"worker 7: .*no answer in 1s"):
        get_all({0: _slow.remote(30.0)}, {0: 7}, 1.0, "set up")

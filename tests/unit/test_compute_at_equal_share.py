"""A rank's step priced at the equal share: a rank on fewer micro-batches reads its own pace,
however few it runs."""

from __future__ import annotations

import pytest
import torch

from elastic_trainer.controller.balance.compute_at_equal_share import EqualShare
from elastic_trainer.worker.compute_clock import ComputeClock

# One step's calls of each pass: the first runs cold, the last launches the gradient buckets.
FIRST, STEADY, LAST = 1.3, 1.0, 1.5


class _Timer:
    def __init__(self, s: float):
        self.s = s

    def seconds(self) -> float:
        return self.s


def calls(n: int, speed: float = 1.0) -> list[float]:
    if n == 1:
        return [speed * (FIRST + LAST - STEADY)]
    return [speed * c for c in [FIRST] + [STEADY] * (n - 2) + [LAST]]


def shape(n: int, speed: float = 1.0) -> dict:
    clock = ComputeClock(torch.device("cpu"))
    clock.begin_step()
    for source in (0, 1):   # a forward and a backward function, n calls each
        clock._calls += [(source, _Timer(c / 2)) for c in calls(n, speed)]
    return clock.pass_shape()


def result(rank: int, n: int, speed: float = 1.0) -> dict:
    s = shape(n, speed)
    return {"rank": rank, "micro_batches": n, "optimizer_s": 0.5, "passes_shape": s,
            "passes_steady_s": s["passes_s"]}


def test_the_clock_gives_the_passes_their_ends_and_their_steady_cost():
    s = shape(4)
    assert s["passes_s"] == pytest.approx(FIRST + 2 * STEADY + LAST) and s["calls"] == 4
    assert s["ends_s"] == pytest.approx(FIRST + LAST) and s["mid_s"] == pytest.approx(STEADY)
    assert s["steady_s"] == pytest.approx(4 * STEADY)
    two = shape(2)
    assert two["mid_s"] is None and two["ends_s"] == pytest.approx(two["passes_s"])
    assert shape(1)["ends_s"] == pytest.approx(FIRST + LAST - STEADY)


@pytest.mark.parametrize("few", [1, 2, 3])
def test_a_rank_on_fewer_micro_batches_reads_its_own_pace(few):
    priced = EqualShare()
    # Replica 1 on ``few`` of 8 micro-batches, replica 0 on the rest; the equal share is 4.
    at_equal = FIRST + 2 * STEADY + LAST + 0.5
    got = priced.compute([result(0, 8 - few), result(1, few)], {0: 0, 1: 0}, 4)
    assert got == pytest.approx({0: at_equal, 1: at_equal})
    slow = priced.compute([result(0, 8 - few), result(1, few, speed=3.0)], {0: 0, 1: 0}, 4)
    assert (slow[1] - 0.5) / (slow[0] - 0.5) == pytest.approx(3.0)


def test_the_ratio_is_remembered_and_without_one_the_calls_are_scaled():
    fresh = EqualShare()
    # No peer has read a steady cost yet: two calls scaled to four count the ends twice.
    plain = fresh.compute([result(1, 2)], {1: 0}, 4)[1]
    assert plain == pytest.approx(2 * (FIRST + LAST) + 0.5)
    fresh.compute([result(0, 6), result(1, 2)], {0: 0, 1: 0}, 4)
    # Later steps where no peer runs three calls use the stage's ratio seen last.
    assert fresh.compute([result(1, 2)], {1: 0}, 4)[1] == pytest.approx(FIRST + 2 * STEADY + LAST + 0.5)
    fresh.reset()
    assert fresh.compute([result(1, 2)], {1: 0}, 4)[1] == pytest.approx(plain)

"""A set-up's time bound grows with the bytes the largest rank builds or restores."""

from elastic_trainer.controller.replanning.setup_time import DEFAULT_BYTES_PER_S, FIXED_S, SetupTime
from elastic_trainer.parallel.topology import Topology
from elastic_trainer.planning.plan import Plan


def plan(pp, bounds):
    return Plan(Topology(1, pp), bounds, [0] * len(bounds))


def test_the_bound_grows_with_the_largest_ranks_bytes_and_a_restore_moves_more():
    counts = [1_000_000, 50_000_000, 50_000_000, 1_000_000]
    t = SetupTime(rendezvous_s=30, stages_per_rank=1)
    two = plan(2, [(0, 2), (2, 4)])
    assert t.largest_rank_bytes(two, counts, restoring=False) == 4 * 51_000_000
    assert t.bound_s(two, counts, False) == 30 + FIXED_S + 4 * 51_000_000 / DEFAULT_BYTES_PER_S
    assert t.bound_s(two, counts, True) == 30 + FIXED_S + 16 * 51_000_000 / DEFAULT_BYTES_PER_S
    assert t.bound_s(two, None, False) == 30 + FIXED_S
    # Measured: the slowest rank's rate, halved.
    t.measured({0: {"params": 25_000_000, "timings": {"build": 1.0, "fetch": 0.0, "load": 0.0},
                    "moved": {"bytes": 0}},
                1: {"params": 10_000_000, "timings": {"build": 2.0, "fetch": 0.0, "load": 0.0},
                    "moved": {"bytes": 0}}})
    assert t.bytes_per_s == 20e6
    assert t.bound_s(two, counts, False) == 30 + FIXED_S + 4 * 51_000_000 / 10e6

import pytest

from elastic_trainer.config import TrainerConfig
from elastic_trainer.planning.policy import candidate_plans, choose_plan
from elastic_trainer.controller.restore import choose_restore
from elastic_trainer.models.factory import block_param_counts


def test_live_copies_win_and_the_latest_covering_step_is_chosen():
    live = {0: {9: [0, 1], 10: [0, 1]}, 1: {9: [2, 3], 10: [2, 3]}}
    snaps = {9: {"a": [0, 1, 2, 3]}}
    step, chosen = choose_restore(4, live, snaps, {})
    assert step == 10 and {s.tier for s in chosen.values()} == {"live"}


def test_a_lost_stage_comes_from_the_snapshot_of_a_step_every_block_has():
    # Blocks 2-3 lived only on a lost worker; its step-10 shard never got replicated.
    live = {0: {9: [0, 1], 10: [0, 1]}}
    snaps = {9: {"r0": [0, 1], "r1": [2, 3]}, 10: {"r0": [0, 1]}}
    step, chosen = choose_restore(4, live, snaps, {})
    assert step == 9
    assert chosen[0].tier == "live" and chosen[2].tier == "snapshot" and chosen[2].holder == "r1"
    assert {s.step for s in chosen.values()} == {9}


def test_a_step_that_did_not_commit_is_never_restored():
    live = {0: {9: [0, 1], 10: [0, 1]}, 1: {9: [0, 1], 10: [0, 1]}}
    assert choose_restore(2, live, {}, {}, max_step=9)[0] == 9


def test_durable_is_the_last_resort_and_none_when_nothing_covers():
    assert choose_restore(2, {}, {}, {4: {0: [0, 1]}})[0] == 4
    assert choose_restore(2, {0: {5: [0]}}, {}, {}) is None


@pytest.fixture
def demo():
    cfg = TrainerConfig.from_yaml("jobs/demo.yaml")
    return cfg, block_param_counts(cfg.model)


def test_policy_keeps_the_global_batch_and_prefers_cheap_plans(demo):
    cfg, counts = demo
    for n in range(1, 6):
        for c in candidate_plans(cfg, counts, n, None):
            assert c.world_size <= n
            assert cfg.train.global_batch_size % (c.dp * cfg.train.micro_batch_size) == 0
    assert (choose_plan(cfg, counts, 4).dp, choose_plan(cfg, counts, 4).pp) == (4, 1)
    three = choose_plan(cfg, counts, 3)
    assert three.world_size <= 3 and (three.dp, three.pp) != (3, 1)  # 16 is not divisible by 3 * 4


def test_policy_respects_worker_memory(demo):
    cfg, counts = demo
    total = sum(counts)
    # Room for a bit more than half the model per worker: a single worker cannot hold it all.
    plans = candidate_plans(cfg, counts, 4, worker_memory_bytes=total * 20 * 0.6)
    assert plans and all(p.pp >= 2 for p in plans)
    assert choose_plan(cfg, counts, 1, worker_memory_bytes=total * 20 * 0.6) is None

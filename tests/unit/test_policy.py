import pytest

from elastic_trainer.config import TrainerConfig
from elastic_trainer.models.factory import block_param_counts
from elastic_trainer.planning.policy import candidate_plans, choose_plan


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

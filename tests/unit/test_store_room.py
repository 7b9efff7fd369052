"""The start says which nodes' object stores are smaller than the snapshots placed there."""

from elastic_trainer.config import TrainerConfig
from elastic_trainer.controller.state.store_room import store_shortfalls
from elastic_trainer.planning.plan import make_plan
from elastic_trainer.planning.policy import rank_store_bytes


def cfg(**ck) -> TrainerConfig:
    return TrainerConfig.model_validate({
        "data": {"path": "x", "seq_len": 16},
        "model": {"kind": "gpt", "n_layer": 4, "n_head": 2, "d_model": 64, "seq_len": 16},
        "train": {"global_batch_size": 8, "micro_batch_size": 2},
        "parallel": {"dp": 2, "pp": 2}, "checkpoint": ck,
    })


def test_a_rank_puts_its_kept_parts_and_holds_its_share_of_the_copies():
    c = cfg()
    plan = make_plan(c)
    per_param = 4 + 8   # weights and AdamW moments
    for stage, got in enumerate(rank_store_bytes(c, 2, 2, plan.stage_bounds)):
        n = plan.stage_params[stage]
        # 2 kept and 1 in flight of its own half (dp=2), and 1 other replica's 2 kept.
        assert got == n * (2 + 1) * per_param // 2 + n * 1 * 2 * per_param // 2
    fewer = cfg(snapshots_kept=1, replicas=1)
    assert rank_store_bytes(fewer, 2, 2, plan.stage_bounds)[0] == plan.stage_params[0] * 2 * per_param // 2


def test_nodes_short_of_store_are_named_with_their_ranks_and_figures():
    c = cfg()
    plan = make_plan(c)
    need = rank_store_bytes(c, 2, 2, plan.stage_bounds)
    rank_nodes = {0: "a", 1: "a", 2: "b", 3: "b"}
    on_a = need[plan.topology.coords(0)[1]] + need[plan.topology.coords(1)[1]]
    stores = {"a": on_a - 1, "b": 10 * on_a}
    [short] = store_shortfalls(c, plan, rank_nodes, stores)
    assert short == {"node": "a", "store_bytes": on_a - 1, "need_bytes": on_a, "ranks": [0, 1]}
    assert store_shortfalls(c, plan, rank_nodes, {"a": on_a, "b": on_a}) == []

"""The re-plan after a failure: the planner's calibrated step time, its memory model, the run's own codec and sync."""

import json

from elastic_trainer.config import TrainerConfig
from elastic_trainer.planning import model_shape as model_shape_module
from elastic_trainer.planning.memory import MemoryModel
from elastic_trainer.planning.model_shape import model_shape
from elastic_trainer.planning.planner import predict_candidates, rank_key, serves
from elastic_trainer.planning.policy import choose_plan, no_plan_reason, rejected_plans


def demo(*overrides: str) -> TrainerConfig:
    return TrainerConfig.from_yaml("jobs/demo.yaml", list(overrides))


def test_the_global_batch_is_kept_and_more_workers_never_hurt():
    cfg = demo()
    t = cfg.train
    previous = None
    for n in range(1, 7):
        c = choose_plan(cfg, n)
        assert c.world_size <= n
        assert t.global_batch_size % (c.dp * t.micro_batch_size) == 0
        assert previous is None or c.est_step_s <= previous
        previous = c.est_step_s
    assert (choose_plan(cfg, 4).dp, choose_plan(cfg, 4).pp) == (4, 1)
    three = choose_plan(cfg, 3)
    assert (three.dp, three.pp) != (3, 1)  # 16 is not divisible by 3 * 4
    assert choose_plan(cfg, 0) is None
    assert choose_plan(demo("parallel.schedule=interleaved"), 1) is None  # interleaving needs pp >= 2


def test_the_choice_is_the_planners_fastest_row_of_the_configured_codec_and_sync():
    for overrides in ([], ["comm.compression=int8"], ["comm.compression=topk"], ["comm.sync=diloco"],
                      ["comm.sync=parameter_server"]):
        cfg = demo(*overrides)
        c = choose_plan(cfg, 4)
        rows = [r for r in predict_candidates(cfg, 4) if serves(r, cfg.comm.compression, cfg.comm.sync)]
        best = min(rows, key=rank_key)
        assert (c.dp, c.pp, c.est_step_s, c.memory_bytes) == (best["dp"], best["pp"], best["total_s"],
                                                                best["memory_bytes"]), overrides
        if c.dp > 1:
            assert f"with {cfg.comm.compression} {cfg.comm.sync}:" in c.reason


def _one_worker_need(cfg) -> int:
    return next(r["memory_bytes"] for r in predict_candidates(cfg, 1) if (r["dp"], r["pp"]) == (1, 1))


def test_memory_counts_activations_and_a_pipeline_can_fit_where_one_worker_cannot():
    cfg = demo("parallel.shard_optimizer=none")   # the unsharded memory model (sharding: test_memory)
    shape = model_shape(cfg)
    m = MemoryModel.of(cfg)
    # A byte under what one worker needs: the whole model's state does not fit; half of it, with a
    # pipeline stage's activations, does.
    bound = _one_worker_need(cfg) - 1
    assert choose_plan(cfg, 1, bound) is None
    two = choose_plan(cfg, 2, bound)
    assert two is not None and (two.dp, two.pp) == (1, 2) and two.memory_bytes <= bound
    # 1f1b: stage s holds min(m, pp - s) of the m = 4 micro-batches, each its blocks' saved tensors and its
    # output; the loss's saved tensors count to the last block. No replicas: no gradient buckets.
    need = []
    for s, (a, b) in enumerate(two.stage_bounds):
        act = sum(shape.saved_bytes[a:b]) + shape.out_bytes[b - 1]
        # No replicas: the live tensors are lent, the parts put into the node's store are the copies.
        per_param = m.weights + m.grads + m.optimizer + m.snapshot_bytes + m.weights + m.optimizer
        need.append(sum(shape.param_counts[a:b]) * per_param + m.runtime + min(4, 2 - s) * act)
    assert two.memory_bytes == max(need)
    assert "MiB per worker of" in two.reason


def test_gpipe_holds_every_micro_batch_so_its_pipeline_does_not_fit_where_1f1b_does():
    one_f = demo("parallel.schedule=1f1b")
    gpipe = demo("parallel.schedule=gpipe")
    assert (choose_plan(one_f, 2).dp, choose_plan(gpipe, 2).dp) == (2, 2)  # unbounded, both replicate
    mem = {s: {(r["dp"], r["pp"]): r["memory_bytes"] for r in predict_candidates(c, 2)}
           for s, c in (("1f1b", one_f), ("gpipe", gpipe))}
    assert mem["1f1b"][(1, 1)] == mem["gpipe"][(1, 1)]  # no pipeline: one micro-batch at a time either way
    assert mem["gpipe"][(1, 2)] > mem["gpipe"][(1, 1)] > mem["1f1b"][(1, 2)]
    bound = mem["1f1b"][(1, 2)]
    assert (choose_plan(one_f, 2, bound).dp, choose_plan(one_f, 2, bound).pp) == (1, 2)
    assert choose_plan(gpipe, 2, bound) is None


def test_the_run_constants_file_prices_the_choice(tmp_path):
    slow = {"algorithms": {k: {"alpha_s": 1.0, "beta_s_per_byte": 1e-9} for k in ("ring", "tree", "chunked")}}
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(slow))
    cfg = demo(f"comm.constants={path}")
    # A second of latency per message: no gradient averaging, no pipeline.
    assert (choose_plan(cfg, 4).dp, choose_plan(cfg, 4).pp) == (1, 1)
    assert (choose_plan(demo(), 4).dp, choose_plan(demo(), 4).pp) == (4, 1)
    # Passed constants win over the file.
    fast = {"algorithms": {k: {"alpha_s": 0.0, "beta_s_per_byte": 0.0} for k in ("ring", "tree", "chunked")}}
    assert choose_plan(cfg, 4, constants=fast).dp == 4


def test_a_repeated_choice_does_not_rebuild_the_model(monkeypatch):
    cfg = demo("model.d_model=64")
    choose_plan(cfg, 3)
    calls = []
    real = model_shape_module.build_blocks_for_shapes
    monkeypatch.setattr(model_shape_module, "build_blocks_for_shapes", lambda *a, **k: calls.append(1) or real(*a, **k))
    for n in (3, 2, 1):
        choose_plan(cfg, n)
    assert calls == []


def test_a_model_that_cannot_run_on_meta_is_still_replanned():
    cfg = TrainerConfig.model_validate({
        "data": {"path": "x", "seq_len": 8},
        "model": {"factory": "tests.unit.test_planner:build_meta_hostile"},
        "train": {"global_batch_size": 4, "micro_batch_size": 1},
    })
    c = choose_plan(cfg, 4)
    assert c is not None and c.world_size <= 4
    assert "activations unknown" in c.reason


def test_when_nothing_fits_the_reasons_say_which_layout_is_over_memory_by_how_much_and_what_would_fit():
    cfg = demo("parallel.shard_optimizer=none")   # the unsharded memory model (sharding: test_memory)
    bound = _one_worker_need(cfg) - 1
    assert choose_plan(cfg, 1, bound) is None
    [one] = rejected_plans(cfg, 1, bound)
    need = next(r["memory_bytes"] for r in predict_candidates(cfg, 1) if (r["dp"], r["pp"]) == (1, 1))
    assert (one.dp, one.pp, one.kind, one.need_bytes, one.over_bytes) == (1, 1, "memory", need, need - bound)
    why = no_plan_reason(cfg, 1, bound)
    assert why.startswith(f"no dp x pp fits 1 worker(s) of {bound / (1 << 20):.1f} MiB")
    assert f"dp=1 pp=1 needs {need / (1 << 20):.1f} MiB, {(need - bound) / (1 << 20):.1f} MiB over" in why
    # On two workers a pipeline fits (test_memory_counts_activations...): the reason says so.
    two = choose_plan(cfg, 2, bound)
    assert f"dp={two.dp} pp={two.pp} on 2 worker(s) would fit" in why
    assert no_plan_reason(cfg, 2, bound) is None


def test_the_reasons_name_the_batch_and_schedule_rules_a_layout_broke():
    cfg = demo()   # global batch 16 of micro-batches of 4
    assert choose_plan(cfg, 3) is not None and no_plan_reason(cfg, 3) is None
    batch = [r for r in rejected_plans(cfg, 3) if r.kind == "batch"]
    assert [(r.dp, r.pp) for r in batch] == [(3, None)]
    assert batch[0].rule == "global_batch_size(16) is not a multiple of dp x micro_batch_size(4)"
    inter = demo("parallel.schedule=interleaved")
    assert choose_plan(inter, 1) is None
    why = no_plan_reason(inter, 1)
    assert "'interleaved' needs pp >= 2" in why and "on 2 worker(s) would fit" in why
    assert choose_plan(cfg, 0) is None and "no workers" in no_plan_reason(cfg, 0)


def test_gpipe_over_the_bound_names_every_layout_it_tried():
    gpipe = demo("parallel.schedule=gpipe")
    bound = {(r["dp"], r["pp"]): r["memory_bytes"] for r in predict_candidates(demo(), 2)}[(1, 2)]
    assert choose_plan(gpipe, 2, bound) is None
    over = {(r.dp, r.pp): r.over_bytes for r in rejected_plans(gpipe, 2, bound) if r.kind == "memory"}
    assert set(over) == {(1, 1), (2, 1), (1, 2)} and all(v > 0 for v in over.values())
    why = no_plan_reason(gpipe, 2, bound)
    assert all(f"dp={dp} pp={pp} needs" in why for dp, pp in over)
    assert "scaling.worker_memory_gb >= " in why
    # On three workers dp=3 is out for the batch as well.
    three = no_plan_reason(gpipe, 3, bound)
    assert "dp=3: global_batch_size(16) is not a multiple of dp x micro_batch_size(4)" in three

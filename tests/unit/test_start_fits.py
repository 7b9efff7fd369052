"""The starting layout is held to ``scaling.worker_memory_gb`` as a re-plan is, before any worker is placed."""

import re

import pytest

from elastic_trainer.config import TrainerConfig
from elastic_trainer.errors import ConfigError
from elastic_trainer.planning.layouts import feasible_layouts
from elastic_trainer.planning.memory import MemoryModel, rank_memory
from elastic_trainer.planning.model_shape import model_shape
from elastic_trainer.planning.plan import make_plan
from elastic_trainer.planning.policy import check_start, choose_plan, cut_fits, plan_shard

MIB = 1 << 20


def demo(*overrides: str) -> TrainerConfig:
    return TrainerConfig.from_yaml("jobs/demo.yaml", list(overrides))


def needs(cfg: TrainerConfig, plan) -> list[tuple[int, int]]:
    """(state, activations) of each PP rank of the plan, as the planner counts them."""
    lay = next(lay for lay in feasible_layouts(cfg, model_shape(cfg).param_counts, plan.topology.world_size)
               if (lay.dp, lay.pp) == (plan.topology.dp, plan.topology.pp))
    assert list(lay.stage_bounds) == plan.stage_bounds  # the start cuts the model as the planner does
    return [(m.state, m.activations) for m in rank_memory(lay, model_shape(cfg), cfg.parallel.schedule,
                                                          model=MemoryModel.of(cfg))]


def fitting(cfg: TrainerConfig, n: int, bound: float) -> set[tuple[int, int]]:
    shape = model_shape(cfg)
    return {(lay.dp, lay.pp) for lay in feasible_layouts(cfg, shape.param_counts, n)
            if max(m.bounded for m in rank_memory(lay, shape, cfg.parallel.schedule,
                                                  model=MemoryModel.of(cfg))) <= bound}


def test_a_start_over_the_bound_fails_naming_the_layout_its_needs_and_what_fits():
    # Between what the demo's 2 x 2 needs and what 1 x 4 on the same four workers needs.
    cfg = demo("scaling.worker_memory_gb=0.43", "parallel.shard_optimizer=none")
    plan = make_plan(cfg)
    per_rank = needs(cfg, plan)
    bound = 0.43 * (1 << 30)
    assert max(map(sum, per_rank)) > bound and not cut_fits(cfg, 2, 2, plan.stage_bounds, bound)
    would = fitting(cfg, 4, bound)
    assert would and (2, 2) not in would   # the re-plan on these four workers would run; the start did not check
    with pytest.raises(ConfigError) as e:
        check_start(cfg, plan)
    msg = str(e.value)
    assert "parallel.dp(2) x parallel.pp(2)" in msg and "stages [[0, 3], [3, 6]]" in msg
    assert "scaling.worker_memory_gb(0.43)" in msg
    # Each pipeline rank's bytes as the planner counts them: parameter state and activations apart.
    for r, (state, act) in enumerate(per_rank):
        assert (f"pp rank {r} needs {(state + act) / MIB:.1f} MiB ({state / MIB:.1f} MiB of state, snapshots and process + "
                f"{act / MIB:.1f} MiB activations)") in msg
    for dp, pp in would:
        assert f"dp={dp} pp={pp}" in msg
    assert choose_plan(cfg, 4, bound) is not None   # the layouts named are those a re-plan could take
    # The smallest bound named for this layout is enough, and no more than that rounded up.
    named = float(re.search(r"scaling\.worker_memory_gb >= ([0-9.e-]+)", msg).group(1))
    assert max(map(sum, per_rank)) <= named * (1 << 30) < max(map(sum, per_rank)) * 1.01
    check_start(demo(f"scaling.worker_memory_gb={named}"), plan)


def test_nothing_fitting_the_workers_says_so_and_names_the_bound_that_would():
    cfg = demo("scaling.worker_memory_gb=0.42")
    plan = make_plan(cfg)
    assert not fitting(cfg, 4, 0.42 * (1 << 30))
    with pytest.raises(ConfigError, match=r"no dp x pp on 4 worker\(s\) fits") as e:
        check_start(cfg, plan)
    assert "scaling.worker_memory_gb >= " in str(e.value)


def test_a_start_within_the_bound_or_without_one_passes():
    check_start(demo(), make_plan(demo()))   # no bound set
    cfg = demo("scaling.worker_memory_gb=0.44")
    assert max(map(sum, needs(cfg, make_plan(cfg)))) <= 0.44 * (1 << 30)
    check_start(cfg, make_plan(cfg))


def test_under_auto_a_start_over_the_bound_unsharded_runs_sharded():
    # The same bound as above: 2 x 2 does not fit whole, and fits with its optimizer sharded.
    cfg = demo("scaling.worker_memory_gb=0.43")
    plan = make_plan(cfg)
    check_start(cfg, plan)
    assert plan_shard(cfg, plan) == "gradients"
    assert plan_shard(demo(), plan) == "none"   # no bound: nothing to fit

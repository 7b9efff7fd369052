"""Re-cutting a pipeline around a slow stage: the cut the cost model picks, when it repays, and
the controller's side (re-cut, paces read at the balanced cut, the balanced cut back)."""

from __future__ import annotations

import pytest

from elastic_trainer.config import BalanceSection, TrainerConfig
from elastic_trainer.controller.balance.stragglers import Balance
from elastic_trainer.models.factory import block_param_counts
from elastic_trainer.parallel.topology import Topology
from elastic_trainer.planning.policy import cut_fits, plan_block_costs, plan_row
from elastic_trainer.planning.recut import (block_costs, cut_for_paces, propose_recut, slowest_stage_s,
                                            stage_paces, stage_work)

from ..conftest import tiny_config


def test_the_cut_gives_a_slow_stage_less_work():
    costs = [1.0] * 8
    assert cut_for_paces(costs, [1.0, 1.0]) == [(0, 4), (4, 8)]
    # Stage 1 at twice the pace: the slowest stage 8 -> 6. Of the cuts that reach 6, [5, 3]
    # (stages 5 and 6) and [6, 2] (6 and 4), the more even one, which also spends less in all.
    assert cut_for_paces(costs, [1.0, 2.0]) == [(0, 6), (6, 8)]
    assert slowest_stage_s(costs, [1.0, 2.0], [(0, 5), (5, 8)]) == pytest.approx(6.0)
    assert slowest_stage_s(costs, [1.0, 2.0], [(0, 6), (6, 8)]) == pytest.approx(6.0)
    assert slowest_stage_s(costs, [1.0, 2.0], [(0, 4), (4, 8)]) == pytest.approx(8.0)
    # Every stage keeps a block, however slow, and the others share the rest evenly.
    assert cut_for_paces(costs, [1.0, 100.0, 1.0]) == [(0, 3), (3, 4), (4, 8)]
    # Uneven blocks (an embedding, a head) weigh by their work.
    assert cut_for_paces([4.0, 1, 1, 1, 1, 4.0], [1.0, 1.0]) == [(0, 3), (3, 6)]
    with pytest.raises(ValueError, match="non-empty"):
        cut_for_paces([1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="> 0"):
        cut_for_paces(costs, [1.0, 0.0])


def test_stage_paces_are_measured_time_over_modelled_work():
    costs = [1.0, 1.0, 2.0, 2.0]
    bounds = [(0, 2), (2, 4)]
    assert stage_work(costs, bounds) == [2.0, 4.0]
    assert stage_paces([0.2, 0.4], costs, bounds) == pytest.approx([0.1, 0.1])
    with pytest.raises(ValueError, match="one per stage"):
        stage_paces([0.2], costs, bounds)


def test_block_costs_follow_the_planners_terms():
    got = block_costs([10, 20], tokens=4, micro_batches=2, rate=1e3, block_cost_s=0.5, optimizer_s_per_param=0.01)
    assert got == pytest.approx([6 * 10 * 4 / 1e3 + 1.0 + 0.1, 6 * 20 * 4 / 1e3 + 1.0 + 0.2])
    cfg = TrainerConfig.from_dict(tiny_config("/nonexistent", parallel={"dp": 1, "pp": 2}))
    costs = plan_block_costs(cfg, 1)
    assert len(costs) == len(block_param_counts(cfg.model)) and all(c > 0 for c in costs)
    # With no memory bound every cut fits; a bound below the model's state fits none.
    assert cut_fits(cfg, 1, 2, [(0, 1), (1, len(costs))], None)
    assert not cut_fits(cfg, 1, 2, [(0, 1), (1, len(costs))], 1.0)


def test_a_recut_is_proposed_only_when_it_repays_two_replans():
    costs, bounds = [1.0] * 8, [(0, 4), (4, 8)]
    prop = propose_recut(costs, bounds, [1.0, 2.0], compute_share=1.0, measured_step_s=0.1, payback_steps=50,
                         cost_s=0.5)
    assert prop.bounds == [(0, 6), (6, 8)]
    # The step's compute scales with the slowest stage (8 -> 6); the rest stays.
    assert prop.predicted_s == pytest.approx(0.1 * 6 / 8)
    half = propose_recut(costs, bounds, [1.0, 2.0], 0.5, 0.1, 50, 0.5)
    assert half.predicted_s == pytest.approx(0.1 * (0.5 + 0.5 * 6 / 8))
    assert prop.figures()["stages"] == [[0, 6], [6, 8]]
    # Not for a gain under ``min_gain`` of the step (here 25%, against 0.1 * 2 / 8).
    assert propose_recut(costs, bounds, [1.0, 2.0], 1.0, 0.1, 50, 0.5, min_gain=0.3) is None
    assert propose_recut(costs, bounds, [1.0, 2.0], 1.0, 0.1, 50, 0.5, min_gain=0.2) is not None
    # Not within 10 steps at 0.5 s; not when the cut is already the best; back to even paces.
    assert propose_recut(costs, bounds, [1.0, 2.0], 1.0, 0.1, 10, 0.5) is None
    assert propose_recut(costs, [(0, 6), (6, 8)], [1.0, 2.0], 1.0, 0.1, 50, 0.5) is None
    back = propose_recut(costs, [(0, 6), (6, 8)], [1.0, 1.0], 1.0, 0.1, 50, 0.01)
    assert back is not None and back.bounds == [(0, 4), (4, 8)]


def _pp2_balance(window=5, payback=1000, replan_s=0.2):
    cfg = TrainerConfig.from_dict(tiny_config("/nonexistent", parallel={"dp": 1, "pp": 2}))
    row = plan_row(cfg, 1, 2)
    costs = plan_block_costs(cfg, 1)
    b = Balance(BalanceSection(window=window, payback_steps=payback), "allreduce", None, lambda: replan_s)
    bounds = tuple(tuple(x) for x in row["stage_bounds"])
    assert row["micro_batches"] == 8
    b.new_plan(Topology(1, 2), 8, lambda: row, bounds, {0: 10, 1: 11}, lambda: costs)
    return b, bounds, costs


def _result(rank, compute):
    return {"rank": rank, "forward_s": compute / 2, "backward_s": compute / 2, "optimizer_s": 0.0, "wait_s": 0.0,
            "micro_batches": 8, "passes_steady_s": compute}


def _run(b: Balance, steps, compute_of):
    events = []
    for step in steps:
        c = compute_of(step)
        evs = b.observe(step, {r: _result(r, v) for r, v in c.items()}, {"worker_s": max(c.values())}, {})
        events += evs + b.act(step, any(e["kind"] == "straggler" for e in evs))
        if b.cut_pending:
            return events
    return events


@pytest.mark.parametrize("head_off_by", [1.0, 3.0])
def test_a_lasting_straggler_in_a_pipeline_gets_a_recut_and_the_balanced_cut_back(head_off_by):
    b, balanced, costs = _pp2_balance()
    # What the blocks really cost: the model's figures, or with the last block (the head, the
    # softmax over the vocabulary) three times what the model says.
    true = costs[:-1] + [costs[-1] * head_off_by]
    work = stage_work(true, balanced)

    def actual(step, slow_from=6, slow_to=10_000, cut=balanced):
        w = stage_work(true, cut)
        factor = {0: 1.0, 1: 3.0 if slow_from <= step < slow_to else 1.0}
        return {r: 0.01 / work[0] * w[r] * factor[r] for r in (0, 1)}

    events = _run(b, range(1, 60), actual)
    named = [e for e in events if e["kind"] == "straggler"]
    [recut] = [e for e in events if e["kind"] == "rebalance"]
    assert [e["rank"] for e in named] == [1]
    assert recut["action"] == "recut" and recut["ranks"] == [1]
    # Lasting first: a window past its onset (a spare waits two).
    assert named[0]["since_step"] + 5 <= recut["step"] < named[0]["since_step"] + 10
    new = b.cut_pending
    assert new[1][1] - new[1][0] < balanced[1][1] - balanced[1][0]
    # Measured time over modelled work: 3x, and more where the head costs more than modelled.
    assert recut["stage_pace"][1] == pytest.approx(3.0 * work[1] / stage_work(costs, balanced)[1], rel=0.02)
    # The controller re-plans: the same workers on the new cut keep their paces.
    b.new_plan(Topology(1, 2), 8, lambda: None, new, {0: 10, 1: 11}, lambda: costs)
    assert b.cut_pending is None and 1 in b.tracker.stragglers
    step0 = recut["step"] + 1
    still = _run(b, range(step0, step0 + 20), lambda s: actual(s, cut=new))
    assert not [e for e in still if e["kind"] in ("rebalance", "straggler_recovered")]
    assert 1 in b.tracker.stragglers   # read at the balanced cut, it is still slow
    assert b.tracker.pace_of(1) == pytest.approx(3.0, rel=0.1)
    # It recovers: the balanced cut comes back (where the model is off too: the first steps on
    # the new cut set each rank's scale from what it computed just before).
    back = _run(b, range(step0 + 20, step0 + 60), lambda s: actual(s, slow_to=0, cut=new))
    assert [e["kind"] for e in back if e["kind"] != "straggler"] == ["straggler_recovered", "rebalance"]
    assert back[-1]["action"] == "balanced cut" and b.cut_pending == balanced


def test_a_new_layout_or_other_workers_start_paces_again():
    b, balanced, costs = _pp2_balance()
    _run(b, range(1, 8), lambda s: {0: 0.01, 1: 0.01})
    assert b.tracker.compute_median(0) is not None
    b.new_plan(Topology(1, 2), 8, lambda: None, balanced, {0: 10, 1: 12}, lambda: costs)
    assert b.tracker.compute_median(0) is None
    _run(b, range(8, 12), lambda s: {0: 0.01, 1: 0.01})
    b.new_plan(Topology(1, 2), 8, lambda: None, balanced, {0: 10, 1: 12}, lambda: costs)   # a retry in place
    assert b.tracker.compute_median(0) is not None


def _slow_then(b, costs, balanced, well_after_recut: bool, until: int):
    """Rank 1 3x slow from step 6, and well again from the re-plan on (``well_after_recut``) or
    not; the controller's side of a re-cut done for it; the events after the re-cut."""
    work = stage_work(costs, balanced)

    def actual(cut, factor):
        w = stage_work(costs, cut)
        return {0: 0.01 / work[0] * w[0], 1: 0.01 / work[0] * w[1] * factor}

    events = _run(b, range(1, 60), lambda s: actual(balanced, 3.0 if s >= 6 else 1.0))
    [recut] = [e for e in events if e["kind"] == "rebalance"]
    new = b.cut_pending
    b.new_plan(Topology(1, 2), 8, lambda: None, new, {0: 10, 1: 11}, lambda: costs)
    return _run(b, range(recut["step"] + 1, until), lambda s: actual(new, 1.0 if well_after_recut else 3.0))


def test_a_rank_that_recovers_during_the_recut_is_not_calibrated_into_reading_slow():
    b, balanced, costs = _pp2_balance()
    # Rank 1 is well again from the first step on the new cut: a 3x change is no model error.
    after = _slow_then(b, costs, balanced, well_after_recut=True, until=200)
    kinds = [(e["kind"], e.get("action")) for e in after]
    assert kinds[:2] == [("straggler_recovered", None), ("rebalance", "balanced cut")], kinds
    assert b.cut_pending == balanced


def test_a_recut_is_measured_again_at_the_balanced_cut_after_payback_steps():
    b, balanced, costs = _pp2_balance(payback=40, replan_s=0.001)
    after = _slow_then(b, costs, balanced, well_after_recut=False, until=200)
    [back] = [e for e in after if e.get("action") == "balanced cut"]
    assert "payback_steps" in back["reason"] and b.cut_pending == balanced
    assert not [e for e in after if e["kind"] == "straggler_recovered"]


def test_a_rank_a_little_slow_besides_neither_joins_nor_holds_the_cut():
    b, balanced, costs = _pp2_balance()
    work = stage_work(costs, balanced)

    def actual(step, cut, slow_to=10_000):
        w = stage_work(costs, cut)
        # Rank 0 reads 1.25x slow from step 6 on (a busy host), rank 1 3x over steps 6 .. slow_to.
        factor = {0: 1.25 if step >= 6 else 1.0, 1: 3.0 if 6 <= step < slow_to else 1.0}
        return {r: 0.01 / work[0] * w[r] * factor[r] for r in (0, 1)}

    events = _run(b, range(1, 60), lambda s: actual(s, balanced))
    assert {e["rank"] for e in events if e["kind"] == "straggler"} == {0, 1}
    [recut] = [e for e in events if e["kind"] == "rebalance"]
    assert recut["action"] == "recut" and recut["ranks"] == [1]
    new = b.cut_pending
    b.new_plan(Topology(1, 2), 8, lambda: None, new, {0: 10, 1: 11}, lambda: costs)
    step0 = recut["step"] + 1
    back = _run(b, range(step0, step0 + 60), lambda s: actual(s, new, slow_to=step0 + 10))
    assert 0 in b.tracker.stragglers   # still a little slow, and the cut goes back all the same
    assert back[-1]["action"] == "balanced cut" and b.cut_pending == balanced
    assert back[-1]["reason"] == "the ranks it was for recovered"


def test_a_straggler_that_came_most_of_the_way_back_is_measured_again_at_the_balanced_cut():
    # Cut for a 3x rank; it then reads 1.4x on the re-cut: still clearly slow, but the cut was
    # priced for 3x. The balanced cut comes back (not a re-cut from the re-cut), to be measured there.
    b, balanced, costs = _pp2_balance()
    work = stage_work(costs, balanced)

    def actual(step, cut, factor_1):
        w = stage_work(costs, cut)
        return {r: 0.01 / work[0] * w[r] * (factor_1 if r == 1 and step >= 6 else 1.0) for r in (0, 1)}

    events = _run(b, range(1, 60), lambda s: actual(s, balanced, 3.0))
    [recut] = [e for e in events if e["kind"] == "rebalance"]
    assert recut["action"] == "recut" and recut["ranks"] == [1]
    new = b.cut_pending
    b.new_plan(Topology(1, 2), 8, lambda: None, new, {0: 10, 1: 11}, lambda: costs)
    step0 = recut["step"] + 1
    back = _run(b, range(step0, step0 + 60), lambda s: actual(s, new, 3.0 if s < step0 + 10 else 1.4))
    assert 1 in b.tracker.stragglers and b.tracker.pace_of(1) > 1 + 2 * 0.15
    moves = [e for e in back if e["kind"] == "rebalance"]
    assert [m["action"] for m in moves] == ["balanced cut"] and b.cut_pending == balanced
    assert "half-way" in moves[0]["reason"]

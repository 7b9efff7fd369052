"""Rebalancing around a straggler: the shares the cost model picks, when they repay, and the
controller's side (act, undo, a blip left alone, detect never acting)."""

from __future__ import annotations

import pytest

from elastic_trainer.config import BalanceSection, TrainerConfig
from elastic_trainer.controller.balance.stragglers import Balance
from elastic_trainer.parallel.topology import Topology
from elastic_trainer.planning.balancing import (predict_step_s, propose_shares, share_micro_batches,
                                                share_quantum)
from elastic_trainer.planning.policy import plan_row

from ..conftest import tiny_config


def test_shares_minimise_the_slowest_replica_and_keep_the_total():
    assert share_micro_batches([1.0, 3.0], 8) == [6, 2]
    assert share_micro_batches([1.0, 1.0], 8) == [4, 4]
    assert share_micro_batches([1.0, 1.5, 1.0], 12) == [5, 3, 4]
    # A 10x straggler still keeps its floor; every replica's time is at most the equal shares'.
    assert share_micro_batches([1.0, 10.0], 8, minimum=2) == [6, 2]
    # The interleaved schedule moves whole multiples of the stages.
    assert share_micro_batches([1.0, 3.0], 16, minimum=2, quantum=2) == [12, 4]
    assert share_micro_batches([1.0, 3.0], 7, minimum=2, quantum=2) is None
    with pytest.raises(ValueError, match="positive"):
        share_micro_batches([1.0, 0.0], 8)


def test_quantum_follows_the_schedule():
    assert share_quantum(1, "1f1b", 4) == (2, 1)
    assert share_quantum(1, "1f1b", 1) == (1, 1)
    assert share_quantum(4, "1f1b", 8) == (4, 1)
    assert share_quantum(2, "interleaved", 8) == (2, 2)


def _row(dp=2, pp=1, **over):
    cfg = TrainerConfig.from_dict(tiny_config("/nonexistent", parallel={"dp": dp, "pp": pp}, **over))
    row = plan_row(cfg, dp, pp)
    assert row is not None and row["micro_batches"] == 8 // dp
    return row


def test_the_prediction_is_the_planners_row_at_equal_pace():
    row = _row()
    assert predict_step_s(row, [1.0, 1.0]) == pytest.approx(row["total_s"])
    # The slowest replica sets the step; moving micro-batches off it shortens it.
    slow = predict_step_s(row, [1.0, 3.0])
    assert slow > 2 * row["compute_s"]
    assert predict_step_s(row, [1.0, 3.0], [6, 2]) < slow
    with pytest.raises(ValueError, match="one per replica"):
        predict_step_s(row, [1.0])


def test_shares_are_proposed_only_when_they_repay_their_cost():
    row = _row()
    prop = propose_shares(row, [1.0, 3.0], None, measured_step_s=0.1, payback_steps=50, cost_s=0.1)
    assert prop.shares == [6, 2] and prop.predicted_s < 0.1 and prop.payback_steps < 50
    # Calibrated by what was measured: the predicted ratio, applied to the measured step.
    ratio = predict_step_s(row, [1.0, 3.0], [6, 2]) / predict_step_s(row, [1.0, 3.0])
    assert prop.predicted_s == pytest.approx(0.1 * ratio)
    # A 4% slower replica is not worth a move within 10 steps at a step's cost; nor are the shares it has.
    assert propose_shares(row, [1.0, 1.04], None, 0.1, 10, 0.1) is None
    assert propose_shares(row, [1.0, 3.0], [6, 2], 0.1, 50, 0.1) is None
    # Back to equal when the paces are.
    back = propose_shares(row, [1.0, 1.0], [6, 2], 0.1, 50, 0.01)
    assert back is not None and back.shares is None


def result(rank, fwd, micro=4, opt=0.0):
    return {"rank": rank, "forward_s": fwd / 2, "backward_s": fwd / 2, "optimizer_s": opt, "wait_s": 0.0,
            "micro_batches": micro, "passes_steady_s": fwd}


def drive(balance: Balance, steps: dict[int, dict[int, float]]):
    events = []
    for step in sorted(steps):
        micro = balance.shares or [4, 4]
        res = {r: result(r, c * micro[r] / 4, micro[r]) for r, c in steps[step].items()}
        record = {"worker_s": max(c * m / 4 for c, m in zip(steps[step].values(), micro))}
        evs = balance.observe(step, res, record, {})
        events += evs + balance.act(step, any(e["kind"] == "straggler" for e in evs))
    return events


def make(mode="act", window=5) -> Balance:
    b = Balance(BalanceSection(mode=mode, window=window), "allreduce")
    b.new_plan(Topology(2, 1), 4, lambda: _row())
    return b


def test_act_moves_shares_off_a_straggler_and_back_when_it_recovers():
    b = make()
    steps = {s: {0: 0.01, 1: 0.01} for s in range(1, 6)}
    steps.update({s: {0: 0.01, 1: 0.03} for s in range(6, 26)})
    steps.update({s: {0: 0.01, 1: 0.01} for s in range(26, 40)})
    events = drive(b, steps)
    moves = [e for e in events if e["kind"] == "rebalance"]
    named = [e for e in events if e["kind"] == "straggler"]
    assert [e["rank"] for e in named] == [1]
    assert moves[0]["step"] == named[0]["step"] and moves[0]["shares"] == [6, 2]
    # The rank keeps its pace on two micro-batches (read at the equal share), so nothing else moves...
    assert len(moves) == 2
    # ...until it recovers: equal shares again, at once.
    assert moves[1]["shares"] is None and moves[1]["reason"] == "the ranks it was for recovered"
    assert b.shares is None


def test_a_one_step_blip_is_not_acted_on_and_detect_never_acts():
    b = make()
    steps = {s: {0: 0.01, 1: 0.01} for s in range(1, 20)}
    steps[10] = {0: 0.01, 1: 0.1}
    assert not [e for e in drive(b, steps) if e["kind"] in ("straggler", "rebalance")]
    d = make("detect")
    slow = {s: {0: 0.01, 1: 0.03} for s in range(1, 20)}
    events = drive(d, slow)
    assert [e["kind"] for e in events] == ["straggler"] and d.shares is None


def test_a_new_plan_starts_on_equal_shares():
    b = make()
    drive(b, {s: {0: 0.01, 1: 0.03} for s in range(1, 10)})
    assert b.shares == [6, 2]
    b.new_plan(Topology(2, 1), 4, lambda: _row())
    assert b.shares is None


def test_a_straggler_no_share_can_help_is_benched_only_when_that_repays():
    from elastic_trainer.planning.policy import PlanChoice

    def make_one_micro(payback: int) -> Balance:
        cfg = TrainerConfig.from_dict(tiny_config("/nonexistent", parallel={"dp": 2, "pp": 1},
                                                  train={"micro_batch_size": 4}))
        row = plan_row(cfg, 2, 1)
        assert row["micro_batches"] == 1   # nothing to move between replicas
        spare = PlanChoice(1, 1, ((0, 8),), row["total_s"] * 1.2, 0, "one worker")
        b = Balance(BalanceSection(window=5, payback_steps=payback), "allreduce", lambda: spare, lambda: 0.2)
        b.new_plan(Topology(2, 1), 1, lambda: row)
        return b

    asked: list = []   # the spare each run's act() asked the loop for (Moves.bench)

    def run(b: Balance):
        events = []
        asked.clear()
        for step in range(1, 30):
            res = {r: result(r, c, 1) for r, c in {0: 0.01, 1: 0.03}.items()}
            evs = b.observe(step, res, {"worker_s": 0.03}, {})
            moves = b.act(step, any(e["kind"] == "straggler" for e in evs))
            events += evs + moves
            if moves.bench:
                asked.append(moves.bench)
                break
        return events

    b = make_one_micro(payback=1000)
    events = run(b)
    named = [e for e in events if e["kind"] == "straggler"]
    spare = [e for e in events if e["kind"] == "rebalance"]
    # Shares first: none can move; once it has lasted two windows the straggler is left out,
    # priced at two set-ups.
    assert [e["action"] for e in spare] == ["spare"]
    assert named[0]["since_step"] + 10 <= spare[0]["step"] <= named[0]["since_step"] + 15
    assert asked[0][0] == 1 and asked[0][1] > 2
    assert spare[0]["cost_s"] == pytest.approx(2 * (0.2 + 2 * 0.03))
    assert spare[0]["plan_after"] == {"dp": 1, "pp": 1} and spare[0]["predicted_step_s"] < 0.03
    # The same straggler, where two re-plans would not repay within 5 steps: it stays.
    b = make_one_micro(payback=5)
    assert not [e for e in run(b) if e["kind"] == "rebalance"] and not asked

"""The step verdict, the spike rule, the anomaly judge and the data skips, without Ray."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from elastic_trainer.config.integrity import IntegritySection
from elastic_trainer.data.skips import add_range, check_ranges, cursor
from elastic_trainer.integrity.anomaly import AnomalyJudge, StepAnomaly
from elastic_trainer.integrity.spikes import SpikeWatch
from elastic_trainer.integrity.verdict import GRADS, LOSS, agree


def _agree(losses, sq, scale=None):
    return agree([torch.tensor(x) for x in losses], scale or 1.0, torch.tensor(sq), 0, 1, 0, 1, None,
                 torch.device("cpu"), sq_div=(scale * scale) if scale else 1.0)


def test_a_lone_rank_verdict_names_its_own_non_finite_values():
    v = _agree([2.0, 4.0], 9.0)
    assert (v.loss, v.grad_norm, v.finite) == (3.0, 3.0, True)
    v = _agree([2.0, float("nan")], 9.0)
    assert not v.loss_finite and v.flags == [LOSS] and v.flagged() == [0]
    v = _agree([2.0], float("inf"))
    assert v.loss_finite and v.flags == [GRADS] and v.grad_norm == math.inf
    v = _agree([2.0 * 8], 9.0 * 64, scale=8.0)   # fp16: both still scaled
    assert (v.loss, v.grad_norm) == (2.0, 3.0)


def test_a_spike_is_far_above_the_median_by_both_tests_and_waits_for_its_history():
    w = SpikeWatch(["loss"], window=10, min_history=5, mads=8.0, ratio=1.5)
    for x in (2.0, 2.1, 1.9, 2.0):
        assert w.judge({"loss": 100.0}) == []   # too little history to judge
        w.accept({"loss": x})
    w.accept({"loss": 2.05})
    assert w.judge({"loss": 2.9}) == []          # far in MADs, but under 1.5x the median
    (spike,) = w.judge({"loss": 3.5})
    assert spike["signal"] == "loss" and spike["median"] == 2.0
    noisy = SpikeWatch(["loss"], window=10, min_history=5, mads=8.0, ratio=1.5)
    for x in (1.0, 3.0, 1.0, 3.0, 2.0):
        noisy.accept({"loss": x})
    assert noisy.judge({"loss": 3.5}) == []      # 1.75x the median, but within the noise
    w.accept({"loss": float("nan")})
    assert len(w.history["loss"]) == 5           # a non-finite value never joins the history
    again = SpikeWatch(["loss"], window=10, min_history=5, mads=8.0, ratio=1.5)
    again.load(w.state())
    assert again.judge({"loss": 3.5}) == w.judge({"loss": 3.5})


def test_the_judge_tells_an_fp16_overflow_from_an_anomaly_and_stops_past_the_limit():
    section = IntegritySection(max_anomalies=2, anomaly_window=10)
    fp16 = AnomalyJudge(section, fp16=True)
    assert fp16.judge(1, _agree([2.0], float("inf")))[0] == "overflow"
    kind, a = fp16.judge(1, _agree([float("nan")], 1.0))
    assert kind == "anomaly" and a["signal"] == "loss" and a["value"] == "nan" and a["ranks"] == [0]
    judge = AnomalyJudge(section, fp16=False)
    kind, a = judge.judge(3, _agree([2.0], float("inf")))
    assert (kind, a["signal"], a["value"]) == ("anomaly", "grad_norm", "inf")
    assert [judge.action(s) for s in (3, 5, 7)] == ["skip", "skip", "stop"]
    assert judge.action(7) == "stop" and len(judge.recent) == 3   # the same try, run again: counted once
    assert judge.action(30) == "skip"           # the window moved on
    e = pickle.loads(pickle.dumps(StepAnomaly(3, {**a, "action": "rollback"}, 48)))
    assert (e.step, e.cursor, e.anomaly["action"]) == (3, 48, "rollback") and "grad_norm is inf" in str(e)


def test_skipped_ranges_are_whole_batches_merged_and_move_each_later_cursor():
    assert check_ranges([[32, 48], [16, 32]], 16) == [(16, 48)]
    with pytest.raises(ValueError, match=r"not whole batches.*multiples of train.global_batch_size \(16\)"):
        check_ranges([[3, 48]], 16)
    with pytest.raises(ValueError, match="empty"):
        check_ranges([[48, 48]], 16)
    ranges = add_range([], 16, 32)                      # step 2's batch skipped: it reads step 3's
    assert [cursor(s, 16, ranges) for s in (1, 2, 3)] == [0, 32, 48]
    ranges = add_range(ranges, 32, 80)                  # then a rollback's window from there
    assert ranges == [(16, 80)] and cursor(2, 16, ranges) == 80


def _fp(params, optim=None):
    return {"params": dict(params), "optim": dict(optim or {}), "sharded": False}


def test_replicas_are_compared_stage_by_stage_on_what_they_hold_alike():
    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.controller.integrity.corruption import compare, compared_parts
    from elastic_trainer.parallel.topology import Topology

    topo = Topology(3, 2)
    stage = {r: topo.coords(r)[1] for r in range(6)}
    fps = {r: _fp({f"s{stage[r]}|param": 10 + stage[r]}, {f"s{stage[r]}|exp_avg": 5}) for r in range(6)}
    assert compare(fps, topo, ("params", "optim")) == []
    odd = topo.rank(1, 1)
    fps[odd] = _fp({"s1|param": 11}, {"s1|exp_avg": 6})
    (found,) = compare(fps, topo, ("params", "optim"))
    assert found["stage"] == 1 and found["groups"][1] == [odd] and found["keys"] == ["optim:s1|exp_avg"]
    assert compare(fps, topo, ("params",)) == []      # a sharded optimizer's slices are not compared
    cfg = TrainerConfig.model_validate({"data": {"path": "x"}, "comm": {"sync": "local_sgd", "local_steps": 4}})
    assert compared_parts(cfg, False, 8) == ("params",) and compared_parts(cfg, False, 9) == ()


def test_a_replay_blames_the_rank_that_cannot_reproduce_its_result_and_nobody_when_none_can():
    from elastic_trainer.controller.integrity.corruption import suspects

    parts = ("params",)
    good, bad, clean = _fp({"w|param": 1}), _fp({"w|param": 2}), _fp({"w|param": 1})
    blamed, why = suspects({1: bad, 3: good}, {1: clean, 3: clean}, parts)
    assert blamed == [1] and "rank 1 could not reproduce its own result" in why
    # dp 3: the odd one out of the replay's majority, even where it reproduces its own result.
    blamed, _ = suspects({0: good, 1: bad, 2: good}, {0: clean, 1: bad, 2: clean}, parts)
    assert blamed == [1]
    # The corruption fed every replica before the check: nobody reproduces, nobody is blamed.
    blamed, why = suspects({1: bad, 3: _fp({"w|param": 3})}, {1: clean, 3: clean}, parts)
    assert blamed == [] and why.startswith("unresolved")


def test_checks_come_every_interval_at_the_last_step_and_where_forced():
    from elastic_trainer.config import TrainerConfig
    from elastic_trainer.controller.integrity.corruption import Corruption

    fixed = Corruption(TrainerConfig.model_validate({"data": {"path": "x"}, "train": {"steps": 23},
                                                  "integrity": {"check_every": 4}}),
                       None, None, None, lambda: None)
    assert fixed.checks(1, 10, snapshot=True) == [4, 8]
    assert fixed.checks(21, 3, snapshot=False) == [23]   # the last step of a 23-step run
    fixed.forced.add(13)
    assert fixed.checks(11, 3, snapshot=False) == [12, 13]
    auto = Corruption(TrainerConfig.model_validate({"data": {"path": "x"}}), None, None, None, lambda: 0.1)
    assert auto.interval() == 10                 # until a check's cost is measured
    auto.costs.append(0.004)                     # 4 ms against 100 ms steps, at most 1% of them
    assert auto.interval() == 4
    off = Corruption(TrainerConfig.model_validate({"data": {"path": "x"}, "integrity": {"check_every": 0}}),
                     None, None, None, lambda: 0.1)
    assert off.checks(1, 10, snapshot=True) == []


def test_a_state_fingerprint_sees_one_flipped_bit():
    from elastic_trainer.integrity.state_fingerprint import differing, state_fingerprint

    p = torch.nn.Parameter(torch.randn(64, 8))
    opt = torch.optim.AdamW([p])
    p.grad = torch.randn_like(p)
    opt.step()
    before = state_fingerprint([("w", p)], opt)
    assert set(before) == {"w|param", "w|step", "w|exp_avg", "w|exp_avg_sq"}
    opt.state[p]["exp_avg"].view(-1).view(torch.int32)[17] ^= 1 << 3
    assert differing(before, state_fingerprint([("w", p)], opt)) == ["w|exp_avg"]


def test_a_rank_s_fault_belongs_to_the_worker_that_was_that_rank_at_the_start():
    from elastic_trainer.worker.integrity_faults import ENV, IntegrityFaults

    env = {ENV: '[{"kind": "flip", "step": 9, "rank": 2}, {"kind": "poison", "steps": [3, 4]}]'}
    first = IntegrityFaults(env)
    first.bind(2, at_start=True)
    first.bind(0, at_start=False)          # later plans move it: the fault goes with it
    assert first.flip(9, 0, "parameter") is not None and first.flip(9, 0, "parameter") is None
    late = IntegrityFaults(env)             # a replacement taking rank 2 over, reading the same env
    late.bind(2, at_start=False)
    assert late.flip(9, 2, "parameter") is None and late.poisoned(16, 8)

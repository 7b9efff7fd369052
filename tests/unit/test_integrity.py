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

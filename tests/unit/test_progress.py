"""Progress output: a live bar on a terminal, plain periodic lines in job logs."""

import io

from elastic_trainer import TrainerConfig
from elastic_trainer.reporting.progress import ProgressPrinter

from ..conftest import tiny_config


def _cfg():
    raw = tiny_config("/nonexistent")
    raw["train"]["steps"] = 40
    raw["run"]["log_every"] = 10
    return TrainerConfig.from_dict(raw)


def _rec(step):
    return {"step": step, "loss": 3.0 - step * 0.01, "tokens_per_s": 1000.0, "step_time_s": 0.5,
            "comm_time_s": 0.01, "exposed_comm_s": 0.01, "dp": 2, "pp": 2}


def test_job_logs_get_periodic_lines_with_an_eta_and_no_carriage_returns():
    cfg = _cfg()
    out = io.StringIO()
    p = ProgressPrinter(cfg, out)
    for s in range(1, 41):
        p.step(_rec(s))
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [ln.split("/")[0].split()[-1] for ln in lines] == ["1", "10", "20", "30", "40"]
    # 20 steps left at 0.5 s each.
    assert "ETA 0:10" in lines[2]


def test_a_terminal_gets_a_bar_redrawn_in_place():
    cfg = _cfg()
    out = io.StringIO()
    p = ProgressPrinter(cfg, out, live=True)
    for s in range(1, 6):
        p.step(_rec(s))
    p.event({"kind": "failure", "step": 6, "failure": "death", "worker": 3, "rank": 3, "node": "abcdef123"})
    text = out.getvalue()
    assert text.count("\r\x1b[2K[") == 5
    assert "5/40" in text and "ETA 0:18" in text
    # An event clears the bar and stands on its own line.
    assert "\r\x1b[2K!! failure at step 6" in text


def test_rebalancing_says_what_moved_and_what_it_buys():
    out = io.StringIO()
    p = ProgressPrinter(_cfg(), out)
    p.event({"kind": "rebalance", "step": 12, "action": "shares", "shares_before": None, "shares": [6, 2],
             "step_s_before": 0.045, "predicted_step_s": 0.026, "payback_steps": 2.3})
    p.event({"kind": "rebalance", "step": 30, "action": "equal shares", "shares_before": [6, 2], "shares": None,
             "reason": "the ranks it was for recovered"})
    lines = out.getvalue().splitlines()
    assert lines[0] == ("-> rebalance: micro-batches per replica equal -> [6, 2], predicted 45.0 -> 26.0 ms/step "
                        "(repays in 2 steps)")
    assert lines[1] == "-> rebalance: equal micro-batches again (the ranks it was for recovered)"


def test_a_spare_and_its_return_are_told():
    out = io.StringIO()
    p = ProgressPrinter(_cfg(), out)
    p.event({"kind": "rebalance", "step": 20, "action": "spare", "rank": 1, "pace": 3.1,
             "plan_after": {"dp": 1, "pp": 1}, "predicted_step_s": 0.02, "step_s_before": 0.05})
    p.event({"kind": "rebalance", "step": 40, "action": "readmit", "worker": 1, "benched_steps": 20, "pace": 1.0})
    p.event({"kind": "rebalance", "step": 41, "action": "readmit", "worker": 2, "benched_steps": 3,
             "reason": "no plan fits the workers that are not benched"})
    lines = out.getvalue().splitlines()
    assert lines[0] == ("-> rebalance: leaving rank 1 out as a spare (pace 3.10): dp=1 x pp=1 predicted 20.0 "
                        "ms/step against 50.0")
    assert lines[1] == "-> rebalance: worker 1 is back to pace 1.00 after 20 steps benched; it may be grown onto"
    assert "worker 2 is let back in (no plan fits" in lines[2]


def test_a_recut_and_the_balanced_cut_back_are_told():
    out = io.StringIO()
    p = ProgressPrinter(_cfg(), out)
    p.event({"kind": "rebalance", "step": 20, "action": "recut", "ranks": [1], "stages_before": [[0, 4], [4, 8]],
             "stages": [[0, 6], [6, 8]], "stage_pace": [1.0, 3.0], "predicted_step_s": 0.04, "step_s_before": 0.06,
             "payback_steps": 12.4, "cost_s": 0.5})
    p.event({"kind": "rebalance", "step": 40, "action": "balanced cut", "stages": [[0, 4], [4, 8]],
             "stages_before": [[0, 6], [6, 8]], "reason": "the ranks it was for recovered"})
    lines = out.getvalue().splitlines()
    assert lines[0] == ("-> rebalance: re-cutting the stages [[0, 4], [4, 8]] -> [[0, 6], [6, 8]] for rank(s) [1] "
                        "(stage paces [1.0, 3.0]), predicted 60.0 -> 40.0 ms/step (repays in 12 steps)")
    assert lines[1] == "-> rebalance: the balanced cut [[0, 4], [4, 8]] again (the ranks it was for recovered)"

"""The PNG run report: a run with a failure and a recovery, a run with no steps, a run that failed."""

import math
import struct

import pytest

from elastic_trainer.reporting.report import FAILURE_COLOR, RECOVERY_COLOR, report_figure, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _history():
    """Steps 1-10 at dp=2 pp=2; step 11 failed and the run resumed from 10 at dp=1 pp=2."""
    out = []
    for step in range(1, 21):
        dp = 2 if step <= 10 else 1
        out.append({"step": step, "loss": 5.0 / step, "cursor": step * 8, "dp": dp, "pp": 2, "world_size": dp * 2,
                    "plan": 0 if step <= 10 else 1, "step_time_s": 0.2 * (3 - dp), "tokens_per_s": 640.0 * dp,
                    "comm_time_s": 0.05, "exposed_comm_s": 0.05, "worker_s": 0.15, "comm_bytes": 1000 * dp, "time": 1000.0 + step})
    return out


def _events():
    return [
        {"kind": "state", "from": "PENDING", "to": "RUNNING", "time": 1000.0},
        {"kind": "failure", "failure": "death", "worker": 3, "rank": 3, "node": "abc", "step": 11, "time": 1011.0},
        {"kind": "recovery", "reason": "death", "failed_step": 11, "restored_step": 10, "detect_s": 0.1,
         "replan_s": 0.1, "restore_s": 0.5, "first_step_s": 0.3, "total_s": 1.0, "time": 1011.5},
        {"kind": "recovery", "reason": "grow", "failed_step": 16, "restored_step": 15, "detect_s": 0.0,
         "replan_s": 0.1, "restore_s": 0.5, "first_step_s": 0.3, "total_s": 0.9, "time": 1016.5},
    ]


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height, len(data)


def _vlines(ax, color):
    from matplotlib.colors import to_rgba

    return sorted(line.get_xdata()[0] for line in ax.get_lines()
                  if to_rgba(line.get_color()) == to_rgba(color) and len(set(line.get_xdata())) == 1
                  and list(line.get_ydata()) == [0, 1])


def test_report_of_a_run_with_a_failure_and_recoveries(tmp_path):
    path = write_report(_history(), _events(), tmp_path / "sub" / "run.png", title="test run")
    assert path == tmp_path / "sub" / "run.png"
    width, height, nbytes = _png_size(path)
    assert (width, height) == (1000, 1200)
    assert 20_000 < nbytes < 2_000_000


def test_report_marks_failures_red_and_recoveries_green_on_every_panel():
    fig = report_figure(_history(), _events())
    axes = fig.get_axes()
    assert len(axes) == 4
    for ax in axes:
        assert _vlines(ax, FAILURE_COLOR) == [11]
        assert _vlines(ax, RECOVERY_COLOR) == [10, 15]
    assert "1 failure(s), 2 recovery(ies)" in fig.get_suptitle()


def test_report_plots_layout_and_comm_share_per_step():
    fig = report_figure(_history(), _events())
    layout, comm = fig.get_axes()[2], fig.get_axes()[3]
    series = {line.get_label(): list(line.get_ydata()) for line in layout.get_lines()
              if not line.get_label().startswith("_")}
    assert series["dp"][:10] == [2] * 10 and series["dp"][10:] == [1] * 10
    assert series["world size"][-1] == 2
    share = list(comm.get_lines()[0].get_ydata())
    assert share[0] == pytest.approx(100 * 0.05 / 0.2) and share[-1] == pytest.approx(100 * 0.05 / 0.4)


def test_a_step_without_timing_leaves_a_gap_not_an_error():
    history = _history()
    history[3] = {**history[3], "step_time_s": 0.0}
    share = list(report_figure(history, []).get_axes()[3].get_lines()[0].get_ydata())
    assert math.isnan(share[3]) and not math.isnan(share[4])


def test_report_of_an_empty_history(tmp_path):
    path = write_report([], [], tmp_path / "empty.png")
    width, height, nbytes = _png_size(path)
    assert (width, height) == (800, 400) and nbytes > 2_000
    texts = [t.get_text() for t in report_figure([], []).texts]
    assert any("no steps completed" in t for t in texts)


def test_report_of_a_run_that_failed_before_any_step(tmp_path):
    events = [
        {"kind": "failure", "failure": "death", "worker": 1, "rank": 1, "node": "n", "step": 1, "time": 1.0},
        {"kind": "failure", "failure": "during_recovery", "worker": [2], "rank": None, "node": None, "step": 1,
         "time": 2.0},
        {"kind": "state", "from": "RECOVERING", "to": "FAILED", "error": "RunError: stopped after 2 failures",
         "time": 3.0},
    ]
    path = write_report([], events, tmp_path / "failed.png")
    assert _png_size(path)[2] > 2_000
    fig = report_figure([], events)
    text = "\n".join(t.get_text() for t in fig.texts)
    assert "no steps completed" in text and "death of worker 1 (rank 1) at step 1" in text
    assert "during_recovery of worker [2] at step 1" in text
    assert "run FAILED: RunError: stopped after 2 failures" in fig.get_suptitle()


def test_report_shows_each_ranks_pace_as_a_heat_strip():
    from elastic_trainer.reporting.report import _pace_grid

    history = _history()
    figures = [{"step": r["step"], "rank_compute_s": {"0": 0.1, "1": 0.1 * (3.0 if 5 <= r["step"] <= 8 else 1.0),
                                                      "2": 0.1}} for r in history]
    grid, ranks, first, last = _pace_grid(figures)
    assert ranks == 3 and grid.shape == (3, len(history)) and (first, last) == (history[0]["step"], history[-1]["step"])
    col = [r["step"] for r in history].index(6)
    assert grid[1, col] == pytest.approx(3.0) and grid[0, col] == 1.0
    fig = report_figure(history, _events(), ranks=figures)
    strip = fig.get_axes()[4]
    assert strip.get_ylabel() == "rank pace" and strip.get_images()
    assert _vlines(strip, FAILURE_COLOR) == [11]
    assert _pace_grid(None) is None and _pace_grid([]) is None     # no per-rank figures: no strip


def test_report_draws_each_ranks_peak_memory_per_step():
    history = _history()
    figures = [{"step": r["step"], "rank_compute_s": {"0": 0.1, "1": 0.1},
                "rank_peak_rss_bytes": {"0": 2 << 30, "1": (3 << 30) if r["step"] >= 5 else (1 << 30)}}
               for r in history]
    fig = report_figure(history, _events(), ranks=figures)
    [panel] = [ax for ax in fig.get_axes() if ax.get_ylabel() == "peak memory (GiB)"]
    assert fig.get_axes().index(panel) == 5   # below the pace strip (its colour bar comes last)
    lines = {ln.get_label(): ln for ln in panel.get_lines() if ln.get_label().startswith("rank")}
    assert set(lines) == {"rank 0", "rank 1"}
    assert list(lines["rank 1"].get_ydata())[-1] == 3.0 and list(lines["rank 0"].get_ydata()) == [2.0] * len(history)
    assert _vlines(panel, FAILURE_COLOR) == [11]
    # Without per-step memory, no panel: the pace strip is the last.
    bare = [{k: v for k, v in f.items() if k != "rank_peak_rss_bytes"} for f in figures]
    labels = [ax.get_ylabel() for ax in report_figure(history, _events(), ranks=bare).get_axes()]
    assert "peak memory (GiB)" not in labels and labels[4] == "rank pace"


def test_the_ranks_file_keeps_the_last_line_of_each_step_and_thins_a_long_run(tmp_path):
    from elastic_trainer.reporting.rank_file import RankFile, read_rank_figures

    f = RankFile(str(tmp_path / "r" / "run.ranks.jsonl"))
    f.write([{"step": s, "pace": {"0": 1.0}} for s in range(1, 6)])
    f.write([{"step": 4, "pace": {"0": 2.0}}, {"step": 5, "pace": {"0": 2.0}}], dropped=3)   # after a rollback
    f.close()
    got = read_rank_figures(f.path)
    assert [g["step"] for g in got] == [1, 2, 3, 4, 5] and got[3]["pace"] == {"0": 2.0} and f.dropped == 3
    assert [g["step"] for g in read_rank_figures(f.path, max_steps=2)] == [1, 4]
    assert read_rank_figures(str(tmp_path / "none.jsonl")) == []

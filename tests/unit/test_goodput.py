"""The goodput clock (controller.run.goodput): wall time charged to what the loop does, moved
where it turns out to have gone, the buckets adding up to the wall time."""

import pytest

from elastic_trainer.controller.run.goodput import BUCKETS, WHAT, GoodputClock, lost_line
from elastic_trainer.reporting.report import report_figure


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_time_goes_to_the_bucket_entered_and_the_buckets_add_up_to_the_wall_time():
    t = _Clock()
    g = GoodputClock("startup", clock=t)
    t.t += 3.0
    g.enter("training")
    t.t += 10.0
    with g.phase("evaluation"):
        t.t += 2.0
    t.t += 5.0
    g.enter("controller")
    t.t += 0.5
    r = g.report()
    assert r["seconds"]["startup"] == 3.0 and r["seconds"]["training"] == 15.0
    assert r["seconds"]["evaluation"] == 2.0 and r["seconds"]["controller"] == 0.5
    assert r["wall_s"] == pytest.approx(20.5) and sum(r["seconds"].values()) == pytest.approx(r["wall_s"])
    assert r["goodput"] == pytest.approx(15.0 / 20.5) and r["effective_s"] == 15.0


def test_moves_take_no_more_than_was_charged_and_the_end_stops_the_clock():
    t = _Clock()
    g = GoodputClock("training", clock=t)
    t.t += 4.0
    # A rollback of steps that took 6 s, of which only 4 s were charged here (a resumed run's
    # steps came from its checkpoint): what moves is what there is.
    assert g.move("training", "redone", 6.0) == 4.0
    g.end()
    t.t += 50.0
    r = g.report()
    assert r["wall_s"] == 4.0 and r["seconds"]["redone"] == 4.0 and r["seconds"]["training"] == 0.0


def test_a_phase_only_from_a_bucket_leaves_other_buckets_alone():
    t = _Clock()
    g = GoodputClock("training", clock=t)
    with g.phase("checkpointing", only_from="controller"):   # steps run meanwhile: training still
        t.t += 1.0
    g.enter("controller")
    with g.phase("checkpointing", only_from="controller"):
        t.t += 2.0
    assert g.bucket == "controller"
    s = g.report()["seconds"]
    assert s["training"] == 1.0 and s["checkpointing"] == 2.0


def test_an_unknown_bucket_is_refused_with_the_known_ones():
    g = GoodputClock()
    with pytest.raises(ValueError, match="unknown goodput bucket 'idle'.*training, startup"):
        g.enter("idle")
    assert set(WHAT) == set(BUCKETS)


def test_the_lost_line_names_the_largest_losses_and_the_report_draws_the_bar():
    report = {"wall_s": 100.0, "effective_s": 90.0, "goodput": 0.9,
              "seconds": {**dict.fromkeys(BUCKETS, 0.0), "training": 90.0, "restore": 6.0, "startup": 4.0}}
    assert lost_line(report) == "goodput 90.0% of 100.0 s; lost: restore 6.0 s, startup 4.0 s"
    assert lost_line({}) == "goodput: not measured yet"
    history = [{"step": s, "loss": 3.0 - 0.1 * s, "tokens_per_s": 100.0, "world_size": 2, "dp": 2, "pp": 1,
                "step_time_s": 0.5, "comm_time_s": 0.1} for s in range(1, 6)]
    fig = report_figure(history, [], "run r", goodput=report)
    bar = fig.subfigs[1].axes[0]
    assert [p.get_width() for p in bar.patches] == [90.0, 4.0, 6.0]
    assert bar.get_title().startswith("goodput 90.0%")

"""Per-rank figures leave the step record, and the controller keeps a bounded number of them."""

from elastic_trainer.controller.run.rank_figures import RANK_FIELDS, RankFigures, split_rank_figures


def test_a_record_loses_its_per_rank_figures_to_a_record_of_their_own():
    record = {"step": 7, "loss": 2.0, "rank_compute_s": {"0": 0.1, "1": 0.2}, "rank_wait_s": {"0": 0.0, "1": 0.1},
              "pace": {"0": 1.0, "1": 2.0}, "shares": [4, 4]}
    figures = split_rank_figures(record)
    assert not set(RANK_FIELDS) & set(record) and record == {"step": 7, "loss": 2.0, "shares": [4, 4]}
    assert figures == {"step": 7, "rank_compute_s": {"0": 0.1, "1": 0.2}, "rank_wait_s": {"0": 0.0, "1": 0.1},
                       "pace": {"0": 1.0, "1": 2.0}}
    assert split_rank_figures({"step": 8, "loss": 1.0}) == {"step": 8}   # balance.mode off


def test_the_controller_keeps_the_newest_figures_and_says_how_many_a_late_reader_missed():
    kept = RankFigures(keep=3)
    for step in range(1, 6):
        kept.append({"step": step})
    assert kept.count == 5 and kept.last() == {"step": 5}
    got, dropped = kept.since(0)
    assert [g["step"] for g in got] == [3, 4, 5] and dropped == 2
    got, dropped = kept.since(4)
    assert [g["step"] for g in got] == [5] and dropped == 0
    assert kept.since(5) == ([], 0) and RankFigures().last() == {}

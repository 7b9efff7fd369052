"""Which worker a campaign's fault is aimed at (``chaos.campaign.strike.victim_of``), at each
kind of hold: a set-up names the workers it sets up by rank, a fence the workers it fenced."""

from elastic_trainer.chaos.campaign.strike import victim_of

WORKERS = [{"worker_id": 10, "rank": 0}, {"worker_id": 11, "rank": 1}, {"worker_id": 12, "rank": None},
           {"worker_id": 13, "rank": 2}]


def test_a_set_up_hold_aims_at_the_worker_it_gives_the_rank():
    held = {"point": "setup", "workers": {"0": 11, "1": 13}}
    assert victim_of(1, held, WORKERS)["worker_id"] == 13
    assert victim_of(3, held, WORKERS)["worker_id"] == 13   # past the plan: by turn


def test_a_fence_hold_aims_at_a_worker_of_the_run_beside_the_fenced():
    held = {"point": "fenced", "workers": [12]}
    assert victim_of(2, held, WORKERS)["worker_id"] == 13
    assert victim_of(4, held, WORKERS)["worker_id"] == 11


def test_no_ranked_worker_no_victim():
    assert victim_of(0, {"point": "between_steps"}, [{"worker_id": 1, "rank": None}]) is None

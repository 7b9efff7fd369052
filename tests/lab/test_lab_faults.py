"""Runs on 4 lab hosts at dp=2 x pp=2, each with one host lost a different way: killed, cut off
and healed, frozen and thawed. Each run finishes, continues the failure-free loss curve, and
after a heal or a thaw nothing of the old plan's workers is in the new plan."""

import time

import pytest

from elastic_trainer.config import TrainerConfig

from ..conftest import tiny_config
from ..helpers import reference_losses
from lab.run import LabRun as Run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FAST_FAILURE = {"startup_timeout_s": 60, "min_step_timeout_s": 5, "rendezvous_timeout_s": 20,
                "wait_for_nodes_s": 2}


def lab_config(corpus, name, steps=24) -> dict:
    # A snapshot every step: a loss redoes at most the step it hit.
    return tiny_config(corpus, run={"name": name}, train={"steps": steps}, parallel={"dp": 2, "pp": 2},
                       failure=FAST_FAILURE, checkpoint={"memory_every": 1}, comm={"timeout_s": 20})


def check_curve(result: dict, config: dict) -> None:
    assert "error" not in result, result.get("error")
    cfg = TrainerConfig.from_dict(config)
    steps = [r["step"] for r in result["history"]]
    assert steps == list(range(1, cfg.train.steps + 1)) and result["state"] == "FINISHED"
    gb = cfg.train.global_batch_size
    assert [r["cursor"] for r in result["history"]] == [(s - 1) * gb for s in steps]   # nothing skipped or redone
    assert [r["loss"] for r in result["history"]] == pytest.approx(reference_losses(cfg, cfg.train.steps), rel=1e-3)


def lost_workers(result: dict, address: str) -> set[int]:
    return {w["worker_id"] for w in result["workers"] if w.get("ip") == address}


def test_a_host_killed(lab, corpus_dir, tmp_path):
    config = lab_config(corpus_dir, "lab-kill")
    run = Run(lab, config, tmp_path)
    ranks = run.await_step(4)
    victim = lab.host_at(ranks[3])
    lab.kill(victim)
    result = run.result()
    check_curve(result, config)
    [rec] = result["recoveries"]
    assert rec["reason"] in ("death", "silent") and rec["plan_after"]["world_size"] < 4, rec


@pytest.mark.parametrize("fault", ["cut", "freeze"])
def test_a_host_lost_then_back_5_s_later_stays_out_of_the_new_plan(lab, corpus_dir, tmp_path, fault):
    # Cut: its link goes down (nothing closes; its peers hear nothing). Freeze: every process
    # of the host stops where it stands. Either way it is back once the run re-planned without
    # it, and 5 s after it went at the least. Its old workers must not disturb the run: they are
    # in no plan after, unless let back in as spares (a fence lifted) and grown onto.
    config = lab_config(corpus_dir, f"lab-{fault}", steps=80)
    run = Run(lab, config, tmp_path)
    ranks = run.await_step(4)
    victim = lab.host_at(ranks[3])
    plan = run.plan()
    lost = time.monotonic()
    (lab.cut if fault == "cut" else lab.freeze)(victim)
    run.await_new_plan(than=plan)
    # The 5 s, counted from the loss: a schedule of the fault, not a wait on the run.
    time.sleep(max(0.0, 5.0 - (time.monotonic() - lost)))
    (lab.heal if fault == "cut" else lab.thaw)(victim)
    result = run.result()
    check_curve(result, config)
    old = {wid for r, wid in result["plans"][0]["workers"].items() if ranks[int(r)] == victim.address}
    assert old, (ranks, result["plans"][0])
    assert result["recoveries"][0]["reason"] == "silent", result["recoveries"][0]
    assert not old & set(result["plans"][1]["workers"].values()), (old, result["plans"][1])
    readmitted = {e["worker"] for e in result["events"] if e["kind"] == "fence" and e["outcome"] == "readmitted"}
    for later in result["plans"][2:]:
        back = old & set(later["workers"].values())
        assert back <= readmitted, (old, readmitted, later)

"""Snapshots off the critical path, memory_every: auto, and restores that keep what a rank holds."""

import pytest
import ray
import torch

from elastic_trainer import Trainer, TrainerConfig
from elastic_trainer.models.factory import block_param_counts
from elastic_trainer.controller.state.snapshot_schedule import CYCLES
from elastic_trainer.naming import NAMESPACE
from elastic_trainer.worker.faults import SNAPSHOT_DELAY_ENV

from ..conftest import tiny_config
from ..helpers import reference_losses

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def config(corpus, name, steps=30, **sections):
    sections.setdefault("parallel", {"dp": 2, "pp": 2})
    sections.setdefault("failure", {"startup_timeout_s": 30, "min_step_timeout_s": 3, "allow_fault_injection": True})
    return TrainerConfig.from_dict(tiny_config(corpus, run={"name": name}, train={"steps": steps}, **sections))


def choices(result):
    return [e for e in result.events if e["kind"] == "snapshot_interval"]


def snapshot_steps(result):
    return [r["step"] for r in result.history if r["snapshot"]]


def test_auto_spreads_out_snapshots_made_slow_and_says_so(cluster, corpus_dir):
    # Every snapshot holds its step 0.1 s (the hook), on steps of a few tens of milliseconds.
    # One pipeline of two (the interval's choice is per run, not per replica): each run's start
    # is mostly its workers' imports, and two start faster than four.
    cfg = config(corpus_dir, "slowsnap", steps=40, parallel={"dp": 1, "pp": 2},
                 scaling={"env_vars": {SNAPSHOT_DELAY_ENV: "0.1"}})
    seen = {}

    def on_step(rec):
        if rec["step"] >= 30 and not seen:
            ctl = ray.get_actor("slowsnap-controller", namespace=NAMESPACE)
            seen.update(ray.get(ctl.status.remote())["snapshots"])

    result = Trainer(cfg, verbose=False, on_step=on_step).fit()
    [choice] = choices(result)
    # Spread out: the measured cost (about the hook's 0.1 s; benchmarks/scale.py reports auto's
    # choice with its cost) takes more than the budget at one a step.
    assert choice["interval"] > 1, choice
    assert choice["expected_overhead"] <= 0.05 and choice["redo_steps"] == choice["interval"] + 1
    # While measuring: every step of the warm-up and of the "with" window, none of the "without" one.
    taken = snapshot_steps(result)
    assert taken[:8] == list(range(1, 9)) and not set(taken) & set(range(9, choice["step"] + 1))
    after = [s for s in taken if s > choice["step"]]
    assert all(b - a >= choice["interval"] for a, b in zip(after, after[1:])), (after, choice)
    assert seen["mode"] == "auto" and seen["interval"] == choice["interval"] and not seen["measuring"]


def test_auto_keeps_cheap_snapshots_every_step(cluster, corpus_dir):
    # A snapshot costs the tiny model a few milliseconds; a budget that covers that keeps one a step.
    cfg = config(corpus_dir, "cheapsnap", steps=24, parallel={"dp": 1, "pp": 2}, checkpoint={"max_overhead": 1.0})
    result = Trainer(cfg, verbose=False).fit()
    [choice] = choices(result)
    assert choice["interval"] == 1 and choice["redo_steps"] == 2, choice
    assert snapshot_steps(result)[-3:] == [22, 23, 24]


def test_overlapped_and_synchronous_snapshots_train_alike(cluster, corpus_dir):
    ref = reference_losses(config(corpus_dir, "ref", steps=12), 12)
    states = []
    for overlap in (True, False):
        # A pipeline of two: the overlap is each rank's own (its snapshot beside its next step).
        # Balancing off: on a loaded host it may move a micro-batch in one run and not the other,
        # which changes the order of the gradient's sums, and the states would differ by that.
        cfg = config(corpus_dir, f"overlap{overlap}", steps=12, parallel={"dp": 1, "pp": 2},
                     checkpoint={"memory_every": 1, "overlap": overlap}, balance={"mode": "off"})
        result = Trainer(cfg, verbose=False).fit(return_model_state=True)
        assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-4)
        assert all(r["snapshot"] for r in result.history)
        states.append(result.model_state)
    # Taking the snapshot beside the next step changes nothing the training computes.
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_a_rollback_on_the_same_workers_reuses_every_block_and_moves_nothing(cluster, corpus_dir):
    cfg = config(corpus_dir, "reuse", steps=30, checkpoint={"memory_every": 1})
    injected = []

    def inject(rec):
        if not injected:
            # The next step the worker runs raises (steps are seen late: a step number could be past).
            injected.append(rec["step"])
            ray.get(ray.get_actor("reuse-rank1-r0s1", namespace=NAMESPACE).inject_fault.remote("raise"))

    result = Trainer(cfg, verbose=False, on_step=inject).fit()
    [rec] = result.recoveries
    assert rec["failed_step"] > injected[0]
    assert rec["restored_step"] == rec["failed_step"] - 1 and rec["plan_after"] == rec["plan_before"]
    # Every rank restored its own local copy into the blocks it held: nothing built, nothing fetched.
    assert rec["blocks_reused"] == len(block_param_counts(cfg.model)) * 2 and rec["blocks_built"] == 0
    assert rec["restore_bytes"] == 0 and rec["restore_rate_bytes_s"] is None
    ref = reference_losses(cfg, cfg.train.steps)
    assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-4)


def test_auto_measures_again_after_a_recovery(cluster, corpus_dir):
    cfg = config(corpus_dir, "remeasure", steps=60)
    target = []

    def inject(rec):
        if not target:
            target.append(rec["step"] + 16)  # after the first choice (step 14)
            ray.get(ray.get_actor("remeasure-rank1-r0s1", namespace=NAMESPACE).inject_fault.remote("raise",
                                                                                                   step=target[0]))

    result = Trainer(cfg, verbose=False, on_step=inject).fit()
    [rec] = result.recoveries
    first, second = choices(result)
    assert first["step"] == 14 and rec["restored_step"] <= target[0] - 1
    if first["interval"] >= 3:
        # The same layout again: the last choice is the estimate, checked on the steps it runs
        # (CYCLES whole cycles from the first snapshot), with no snapshot taken only to measure.
        assert second["estimated_interval"] == first["interval"] and second["measuring_snapshots"] == 0
        assert second["step"] == rec["restored_step"] + first["interval"] * (1 + CYCLES)
    else:
        # Measured from the restored step as from the start: warm-up, with, gap, without.
        assert second["step"] == rec["restored_step"] + 14 and second["estimated_interval"] is None

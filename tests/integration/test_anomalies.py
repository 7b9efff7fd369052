"""Steps that would poison training: a NaN and a spiking loss, judged on every rank alike and never
applied; skipped (the batch left out), rolled back (the batches since the snapshot left out) or
ending the run (integrity.on_anomaly)."""

import json
import os

import pytest
import torch

from elastic_trainer import RunError, Trainer, TrainerConfig

from ..conftest import tiny_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
STEPS, NAN_STEP = 24, 20
GB = 8


def _cfg(corpus_dir, faults=(), name="anomaly", **integrity):
    raw = tiny_config(corpus_dir, run={"name": name}, parallel={"dp": 2, "pp": 2},
                      train={"steps": STEPS, "global_batch_size": GB},
                      checkpoint={"memory_every": 4},
                      failure={"allow_fault_injection": True},
                      scaling={"env_vars": {"ELASTIC_TRAINER_INTEGRITY_FAULTS": json.dumps(list(faults))}},
                      integrity=integrity)
    return TrainerConfig.from_dict(raw)


def _anomalies(result):
    return [e for e in result.events if e["kind"] == "anomaly"]


def test_a_nan_skipped_is_the_run_that_skipped_its_batch_by_design_and_a_rollback_names_its_window(
        cluster, corpus_dir):
    # Rank 3 holds the last stage of replica 1: one of its micro-batches' loss turns NaN at step 20.
    nan = [{"kind": "nan", "step": NAN_STEP, "rank": 3, "micro_batch": 1}]
    skipped = Trainer(_cfg(corpus_dir, nan), verbose=False).fit(return_model_state=True)
    (ev,) = _anomalies(skipped)
    assert (ev["step"], ev["anomaly"], ev["signal"], ev["value"], ev["action"]) == (NAN_STEP, "nonfinite", "loss",
                                                                                   "nan", "skip")
    assert ev["ranks"] == [3] and ev["samples"] == [(NAN_STEP - 1) * GB, NAN_STEP * GB]
    cursors = [r["cursor"] for r in skipped.history]
    assert cursors == [(s - 1) * GB for s in range(1, NAN_STEP)] + [s * GB for s in range(NAN_STEP, STEPS + 1)]
    assert all(r["grad_norm"] > 0 for r in skipped.history)

    design = Trainer(TrainerConfig.from_dict({**_cfg(corpus_dir).model_dump(mode="json"),
                                              "data": {**_cfg(corpus_dir).data.model_dump(mode="json"),
                                                       "skip_samples": [ev["samples"]]}}),
                     verbose=False).fit(return_model_state=True)
    assert not _anomalies(design)
    assert [r["loss"] for r in skipped.history] == [r["loss"] for r in design.history]
    for name, want in design.model_state.items():
        assert torch.equal(skipped.model_state[name], want), name

    rolled = Trainer(_cfg(corpus_dir, nan, on_anomaly="rollback"), verbose=False).fit(return_model_state=True)
    (ev,) = _anomalies(rolled)
    # Back to the snapshot of step 16; the batches of steps 17-20 left out, step 17 reads step 21's.
    assert (ev["action"], ev["restored_step"], ev["samples"]) == ("rollback", 16, [16 * GB, NAN_STEP * GB])
    assert [r["cursor"] for r in rolled.history][16:] == [s * GB for s in range(20, 28)]
    assert rolled.state == "FINISHED" and len(rolled.history) == STEPS
    (rec,) = [e for e in rolled.events if e["kind"] == "recovery"]
    assert rec["reason"] == "anomaly" and not [e for e in rolled.events if e["kind"] == "failure"]


def test_a_poisoned_window_spikes_the_loss_and_a_stop_ends_the_run_with_the_state_before_it(
        cluster, corpus_dir):
    # Judged from step 21 (integrity.spike_min_history: 20): the window at step 22, whose targets
    # are all one rare token. This early the norm is noisy (measured: 4.2 against a median of 1.8,
    # MAD 0.3): the test judges the norm, at 3 MADs and 2x, where by default it is not judged (and
    # 6 MADs and 10x would take it for noise).
    poison = [{"kind": "poison", "steps": [22, 22]}]
    cfg = _cfg(corpus_dir, poison, name="spike", on_anomaly="stop", spikes=["loss", "grad_norm"], spike_mads=3.0,
               spike_ratio_grad_norm=2.0)
    with pytest.raises(RunError, match=r"step 22 was anomalous: grad_norm .* spiked .*integrity.on_anomaly: stop"):
        Trainer(cfg, verbose=False).fit()
    # The last good step's state, on the workers still: what the run left.
    with open(os.path.join(cfg.run.output_dir, "model.safetensors.index.json")) as f:
        assert json.load(f)["metadata"]["step"] == 21

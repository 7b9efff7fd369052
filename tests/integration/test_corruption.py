"""Silent data corruption: a flipped bit in one replica's state is found by the replicas' check,
proven by replay (or by its own checksum, for a sharded optimizer's slice), its node quarantined,
and the run goes on from the state every replica agreed on."""

import json

import pytest
import torch

from elastic_trainer import Trainer, TrainerConfig

from ..conftest import tiny_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
STEPS = 24


def _cfg(corpus_dir, name, faults=(), **parallel):
    raw = tiny_config(corpus_dir, run={"name": name}, parallel={"dp": 2, "pp": 2, **parallel},
                      train={"steps": STEPS}, checkpoint={"memory_every": 4},
                      failure={"allow_fault_injection": True},
                      scaling={"env_vars": {"ELASTIC_TRAINER_INTEGRITY_FAULTS": json.dumps(list(faults))}},
                      integrity={"check_every": 4})
    return TrainerConfig.from_dict(raw)


def test_a_flipped_parameter_is_proven_by_replay_quarantined_and_the_run_ends_as_the_clean_one(
        fresh_cluster, corpus_dir):
    fresh_cluster(5)   # four ranks and a spare to move the quarantined one to
    clean = Trainer(_cfg(corpus_dir, "sdc-clean"), verbose=False).fit(return_model_state=True)
    assert not [e for e in clean.events if e["kind"] in ("corruption", "anomaly")]
    # Rank 1 (replica 0, stage 1): one mantissa bit of its first parameter, as step 12's update
    # wrote it (a faulty update, on one replica only).
    flip = [{"kind": "flip", "where": "parameter", "step": 12, "rank": 1, "bit": 12}]
    result = Trainer(_cfg(corpus_dir, "sdc-flip", flip), verbose=False).fit(return_model_state=True)
    (ev,) = [e for e in result.events if e["kind"] == "corruption"]
    # Found at the check of that step, replayed from the last agreed one (step 8): rank 3 reproduces.
    assert (ev["step"], ev["stage"], ev["suspects"], ev["agreed_step"]) == (12, 1, [1], 8), ev
    assert "rank 1 could not reproduce its own result" in ev["proof"] and ev["quarantined"] == ev["nodes"]
    (node,) = ev["nodes"]
    assert not any(w["node_id"] == node for w in result.workers if w.get("rank") is not None)
    # The run waited for the replacement started for it, which took its place: the layout stays.
    assert (result.plans[-1]["dp"], result.plans[-1]["pp"], result.plans[-1]["from_step"]) == (2, 2, 13)
    assert [r["step"] for r in result.history] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in result.history] == [r["loss"] for r in clean.history]
    for name, want in clean.model_state.items():
        assert torch.equal(result.model_state[name], want), name


def test_a_flip_in_a_sharded_optimizer_slice_is_found_by_its_checksum(fresh_cluster, corpus_dir):
    fresh_cluster(5)
    # Checked at step 8; rank 2's slice of its moments flipped before step 9's update.
    flip = [{"kind": "flip", "where": "optimizer", "step": 9, "rank": 2, "bit": 12}]
    result = Trainer(_cfg(corpus_dir, "sdc-zero", flip, shard_optimizer="optimizer"), verbose=False).fit()
    (ev,) = [e for e in result.events if e["kind"] == "corruption"]
    assert (ev["step"], ev["suspects"], ev["agreed_step"]) == (9, [2], 8), ev
    assert ev["proof"].startswith("checksum") and ev["nodes"] == ev["quarantined"]
    (rec,) = [e for e in result.events if e["kind"] == "recovery" and e["reason"] == "corruption"]
    # A snapshot no later than the last agreed step (that of step 8 had not committed: the copies
    # of a snapshot step are confirmed by the next step's results, and step 9 had none).
    assert rec["restored_step"] in (4, 8), rec
    assert result.state == "FINISHED" and [r["step"] for r in result.history] == list(range(1, STEPS + 1))

"""Sharded optimizer state (ZeRO-1/2) on Ray: node losses re-shard from the snapshot's slices, and
durable checkpoints load under any sharding."""

import json

import pytest
import ray

from elastic_trainer import Trainer
from elastic_trainer.models.factory import block_param_counts
from elastic_trainer.naming import NAMESPACE

from ..helpers import reference_losses
from .conftest import add_node
from .test_recovery import Chaos, assert_contiguous_data, config, node_of_rank

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _follows_reference(result, cfg, change):
    ref = reference_losses(cfg, change + 9)
    got = [r["loss"] for r in result.history]
    assert got[:change - 1] == pytest.approx(ref[:change - 1], rel=1e-4)
    # The first step after the restore runs on the restored state alone: its loss is the
    # failure-free run's; the update after it used the restored moments.
    assert got[change - 1:change + 9] == pytest.approx(ref[change - 1:change + 9], rel=1e-3)


def test_dp_down_then_up_under_zero2_restores_the_saved_state_bit_for_bit(fresh_cluster, corpus_dir):
    """dp 3 -> 2 -> 3: a node lost, then one added. Each restore re-shards the snapshot's slices,
    moving only what each rank now needs, and is checked tensor by tensor against the state saved
    (checkpoint.verify_restores: weights on every replica, moments summed over each new group)."""
    c, nodes = fresh_cluster(3)
    cfg = config(corpus_dir, "zgrow", steps=2000, train={"global_batch_size": 12},
                 parallel={"dp": 3, "pp": 1, "shard_optimizer": "gradients"},
                 checkpoint={"verify_restores": True}, scaling={"grow_check_s": 0.5})
    added, grown = [], []

    def on_step(rec, chaos=Chaos().at(4, lambda: c.remove_node(node_of_rank("zgrow", 2, nodes), allow_graceful=False))):
        chaos(rec)
        if rec["world_size"] == 2 and not added:
            added.append(add_node(c))
        if added and rec["world_size"] == 3:
            grown.append(rec["step"])
            if len(grown) == 10:
                ray.get(ray.get_actor("zgrow-controller", namespace=NAMESPACE).stop.remote("grown"))

    result = Trainer(cfg, verbose=False, on_step=on_step).fit()
    assert result.state == "STOPPED" and len(grown) >= 10, (result.state, grown)
    assert_contiguous_data(result, cfg, last=result.step)
    loss, grow = result.recoveries
    # A killed node is seen by its peers' broken connections or by its heartbeat's silence,
    # whichever comes first (under load, either), as in test_recovery.
    assert loss["reason"] in ("death", "silent") and grow["reason"] == "grow", (loss["reason"], grow["reason"])
    assert [(r["plan_after"]["dp"], r["plan_after"]["pp"]) for r in (loss, grow)] == [(2, 1), (3, 1)]
    for rec in (loss, grow):
        # Every block from the group's slices; the state then held is the state saved, bit for bit.
        assert rec["sources"] == {"snapshot": len(block_param_counts(cfg.model))}
        check = rec["restore_check"]
        assert check["differ"] == [] and check["unverified"] == 0 and check["tensors"] > 0, check
        # Each slice is cut where it lies to its reader's weights and owned moments.
        assert 0 < rec["restore_bytes"] < rec["restore_regather_bytes"], rec
    # As where a stage has one replica: the newest snapshot may still wait for its pins.
    assert loss["steps_redone"] <= 2 and loss["parts_from_holders"] >= 1
    _follows_reference(result, cfg, loss["failed_step"])


def test_a_stage_lost_whole_under_zero1_comes_back_from_the_object_store(fresh_cluster, corpus_dir):
    """Both replicas of stage 0 at once: no live rank holds any of its slices."""
    c, nodes = fresh_cluster(4)
    cfg = config(corpus_dir, "zloss2", parallel={"dp": 2, "pp": 2, "shard_optimizer": "optimizer"},
                 checkpoint={"verify_restores": True})

    def kill():
        lost = [node_of_rank("zloss2", r, nodes) for r in (0, 2)]
        for n in lost:
            c.remove_node(n, allow_graceful=False)

    result = Trainer(cfg, verbose=False, on_step=Chaos().at(4, kill)).fit()
    assert_contiguous_data(result, cfg)
    assert len(result.recoveries) >= 1
    rec = result.recoveries[-1]
    assert set(rec["sources"]) == {"snapshot"}
    assert rec["parts_from_holders"] >= 2   # the lost ranks' parts, read from their pinned copies
    check = rec["restore_check"]
    assert check["differ"] == [] and check["unverified"] == 0 and check["tensors"] > 0, check
    _follows_reference(result, cfg, result.recoveries[0]["failed_step"])


def test_durable_checkpoints_load_under_any_sharding(cluster, corpus_dir, tmp_path):
    """Written under ZeRO-2 at 2 x 2, resumed whole at 2 x 1 (whole parts loading into sharded
    ranks: tests/unit/test_sharded_optimizer.py). The first run's workers run on jemalloc (the
    default), the second's on the system allocator (``scaling.cpu_allocator``)."""
    ck = {"storage": str(tmp_path / "ck"), "durable_every": 3}
    runs = [("gradients", 2, 3, "jemalloc"), ("none", 1, 6, "system")]
    for i, (shard, pp, steps, allocator) in enumerate(runs):
        cfg = config(corpus_dir, "zdur", steps=steps, checkpoint=ck, parallel={"dp": 2, "pp": pp, "shard_optimizer": shard},
                     scaling={"cpu_allocator": allocator})
        result = Trainer(cfg, verbose=False).fit(**({"resume": True, "accept_change": ["train.steps"]} if i else {}))
        assert {w["allocator"] for w in result.workers} == {allocator}, result.workers
        if i:
            [ev] = [e for e in result.events if e["kind"] == "resume"]
            assert ev["step"] == runs[i - 1][2]
        # A sharded run's checkpoint is its ranks' slices, one file each; an unsharded one's, whole stages.
        [manifest] = (tmp_path / "ck").glob(f"step-{steps:08d}-*/manifest.json")
        files = json.loads(manifest.read_text())["files"]
        assert [f.get("sliced", False) for f in files] == [shard != "none"] * (4 if shard != "none" else 1)
    assert [r["step"] for r in result.history] == list(range(1, 7))
    assert [r["loss"] for r in result.history] == pytest.approx(reference_losses(cfg, 6), rel=1e-4)

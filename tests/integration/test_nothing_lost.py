"""Nothing lost: the trained weights saved (and a failed save failing the run), durable checkpoints
that belong to their run, a bounded object store with a slow holder, and an emergency copy on any
error. Node losses at start-up and during a recovery's set-up: tests/integration/test_soak.py."""

import os
import shutil
import statistics

import pytest
import ray
import torch
from torch import nn

from elastic_trainer import RunError, Trainer
from elastic_trainer.checkpoint.weights import load_weights
from elastic_trainer.controller.state.saving import SaveError
from elastic_trainer.data.dataset import TokenDataset
from elastic_trainer.data.splits import make_sampler
from elastic_trainer.models import build_model
from elastic_trainer.naming import NAMESPACE
from elastic_trainer.chaos.simulate import object_store_bytes

from ..helpers import reference_run
from .test_recovery import config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _loss_of(weights: dict, cfg, step: int) -> float:
    """The loss of ``weights`` on the batch of ``step`` (1-based), as one process computes it."""
    blocks, loss_fn = build_model(cfg.model, cfg.train.seed)
    model = nn.Sequential(*blocks)
    model.load_state_dict({k[len("blocks."):]: v for k, v in weights.items()})
    data = TokenDataset.open(cfg.data)
    gb = cfg.train.global_batch_size
    x, y = data.sample(make_sampler(cfg, data).rows((step - 1) * gb, gb))
    with torch.no_grad():
        return loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y)).item()


def test_the_weights_are_saved_and_a_failed_save_fails_the_run(cluster, corpus_dir, tmp_path):
    cfg = config(corpus_dir, "weights", steps=6, parallel={"dp": 2, "pp": 2},
                 run={"name": "weights", "output_dir": str(tmp_path / "out")})
    result = Trainer(cfg, verbose=False).fit()
    # Each stage's part by its own rank, the index last: nothing else in the folder.
    assert result.model_path == str(tmp_path / "out")
    assert sorted(os.listdir(result.model_path)) == ["model-00001-of-00002.safetensors",
                                                     "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    saved = [e for e in result.events if e["kind"] == "weights_saved"][-1]
    assert [p["file"] for p in saved["parts"]] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weights = load_weights(result.model_path)
    ref_losses, ref_state = reference_run(cfg, cfg.train.steps + 1)
    # Loaded into the same blocks, the weights give the next step's loss of one process that ran
    # one step more (and their own run's last loss was that process's too).
    assert _loss_of(weights, cfg, cfg.train.steps + 1) == pytest.approx(ref_losses[-1], rel=1e-4)
    assert result.final_loss == pytest.approx(ref_losses[-2], rel=1e-4)
    assert [e for e in result.events if e["kind"] == "state"][-1]["to"] == "FINISHED"

    # A folder that cannot be made (a file stands in its place): FAILED, and each part is kept on
    # its writer's node, where the error says; nothing is carried to the driver.
    (tmp_path / "file").write_text("in the way")
    bad = cfg.with_overrides(["run.name=weights2", f"run.output_dir={tmp_path / 'file' / 'out'}"])
    with pytest.raises(SaveError, match=r"trained 6 steps but did not save the weights .*model-00001-of-00002"
                                        r".*kept on node") as info:
        Trainer(bad, verbose=False).fit()
    parts = info.value.parts
    assert [p["file"] for p in parts] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    try:
        kept = {}
        for p in parts:
            assert p["fallback"] and p["node"] in str(info.value) and p["fallback"] in str(info.value)
            kept.update(load_weights(p["fallback"]))
        assert set(kept) == set(weights) and all(torch.equal(kept[k], weights[k]) for k in weights)
    finally:
        shutil.rmtree(os.path.dirname(parts[0]["fallback"]), ignore_errors=True)


def test_durable_checkpoints_belong_to_their_run(cluster, corpus_dir, tmp_path):
    storage = tmp_path / "ck"
    ck = {"storage": str(storage), "durable_every": 2, "keep_durable": 2}
    first = Trainer(config(corpus_dir, "own1", steps=8, checkpoint=ck), verbose=False).fit()
    theirs = sorted(p.name for p in storage.glob(f"step-*-{first.run_id}"))
    assert len(theirs) == 2 and first.model_path == str(storage / "own1")
    # Each part was written on the node of the worker that made it, not by the controller.
    nodes = {w["node_id"] for w in first.workers}
    for e in (e for e in first.events if e["kind"] == "durable_checkpoint"):
        assert e["parts"] and all(p["node"] in nodes and p["bytes"] > 0 for p in e["parts"]), e
        assert e["bytes"] == sum(p["bytes"] for p in e["parts"])
    # A second run in the same storage, not resumed, stops earlier: its pruning leaves the
    # first run's later checkpoints alone and keeps its own.
    second = Trainer(config(corpus_dir, "own2", steps=4, checkpoint=ck), verbose=False).fit()
    assert sorted(p.name for p in storage.glob(f"step-*-{first.run_id}")) == theirs
    assert len(list(storage.glob(f"step-*-{second.run_id}"))) == 2

    # --resume with another model is refused, naming the field.
    changed = config(corpus_dir, "own3", steps=10, checkpoint=ck, model={"d_model": 64})
    with pytest.raises(RunError, match=r"model\.d_model: checkpoint 32, this run 64"):
        Trainer(changed, verbose=False).fit(resume=second.run_id)
    # With the same model it continues the second run, by its id, as that run.
    resumed = Trainer(config(corpus_dir, "own3", steps=6, checkpoint=ck), verbose=False).fit(
        resume=second.run_id, accept_change=["train.steps"])
    assert resumed.run_id == second.run_id
    assert [e for e in resumed.events if e["kind"] == "resume"][0]["step"] == 4

    # A storage that cannot be listed fails --resume; it is not "no checkpoints".
    (tmp_path / "not-a-dir").write_text("x")
    unlistable = config(corpus_dir, "own4", steps=4, checkpoint={"storage": str(tmp_path / "not-a-dir")},
                        run={"name": "own4", "output_dir": str(tmp_path / "o4")})
    with pytest.raises(RunError, match=r"--resume cannot read checkpoint.storage.*cannot list"):
        Trainer(unlistable, verbose=False).fit(resume=True)


def test_object_store_stays_flat_over_200_steps_with_a_slow_holder(cluster, corpus_dir):
    # dp=1 x pp=2: each stage's part is pinned by the other rank. Rank 1 takes 2 s per pin.
    cfg = config(corpus_dir, "slowpin", steps=200, parallel={"dp": 1, "pp": 2},
                 failure={"pin_timeout_s": 1.0})
    samples = []

    def on_step(rec):
        if rec["step"] == 1:
            ray.get(ray.get_actor("slowpin-rank1-r0s1", namespace=NAMESPACE).inject_fault.remote(
                "slow_pin", seconds=2.0))
        if rec["step"] % 2 == 0:
            samples.append((rec["step"], object_store_bytes()))

    result = Trainer(cfg, verbose=False, on_step=on_step).fit()
    assert len(result.history) == 200
    dropped = [e for e in result.events if e["kind"] == "snapshot_dropped"]
    assert len(dropped) > 50, "the slow holder slowed nothing: the test proves nothing"
    early = statistics.median(b for s, b in samples if 20 <= s <= 80)
    late = statistics.median(b for s, b in samples if s > 140)
    state = sum(4 * 3 * p.numel() for b in build_model(cfg.model, 0)[0] for p in b.parameters())
    # Flat. Ray frees objects in batches about once a second, so tens of steps' parts come and
    # go (the same with a fast holder); a snapshot kept for every step that never commits would
    # add a model state per step, 60 or more from the early window to the late one.
    assert late <= early + 20 * state, (early, late, state, samples)


def test_any_controller_error_saves_the_newest_snapshot_first(cluster, corpus_dir, tmp_path):
    from elastic_trainer.checkpoint.durable import DurableStore

    def crash_soon(name):
        def on_step(rec):
            if rec["step"] == 3:
                ray.get(ray.get_actor(f"{name}-controller", namespace=NAMESPACE).inject_fault.remote(
                    "controller_error"))
        return on_step

    # With storage (and no durable_every): the emergency copy is a durable checkpoint, resumable.
    storage = str(tmp_path / "ck")
    cfg = config(corpus_dir, "crash1", steps=30, checkpoint={"storage": storage})
    with pytest.raises(RuntimeError, match=r"injected controller error at step \d+"):
        Trainer(cfg, verbose=False, on_step=crash_soon("crash1")).fit()
    shards, manifest, _ = DurableStore(storage).load_latest(own=False)
    assert manifest["step"] >= 3 and manifest["run_name"] == "crash1"
    # Without: the newest snapshot's weights, beside where the final ones would have gone.
    out = tmp_path / "out"
    cfg = config(corpus_dir, "crash2", steps=30, run={"name": "crash2", "output_dir": str(out)})
    with pytest.raises(RuntimeError, match=r"injected controller error at step \d+"):
        Trainer(cfg, verbose=False, on_step=crash_soon("crash2")).fit()
    [saved] = out.glob("model-step-*")
    assert int(saved.name[11:19]) >= 3 and len(load_weights(str(saved))) > 0

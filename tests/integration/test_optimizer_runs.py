"""Optimizers other than AdamW through Ray and a node loss: the state of each (Adafactor's
factored statistics whole, a user Lion's momentum sharded) is saved, re-planned onto the survivors
and restored bit for bit, and the run follows single-process torch with the same optimizer.

Each optimizer's exactness at 2 x 2 against torch, sharded where it can be, is
``tests/unit/test_optimizer_layouts.py`` (gloo ranks, no Ray)."""

import pytest

from elastic_trainer import Trainer

from ..helpers import reference_losses
from .test_recovery import Chaos, assert_contiguous_data, config, node_of_rank

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

CASES = {
    # Not elementwise: never sharded; the re-plan moves whole parameters with their row/col factors.
    "adafactor": ({"name": "Adafactor", "param_groups": [{"match": "*.bias", "weight_decay": 0.0}]}, "auto"),
    # A user class by import path, elementwise by its own word: sharded, and re-sharded at the loss.
    "lion": ({"name": "tests.optim_lion:Lion", "kwargs": {"weight_decay": 0.1}}, "gradients"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_node_loss_restores_the_optimizers_state_and_the_run_follows_torch(fresh_cluster, corpus_dir, case):
    optimizer, shard = CASES[case]
    c, nodes = fresh_cluster(4)
    name = f"opt-{case}"
    cfg = config(corpus_dir, name, steps=12, train={"optimizer": optimizer},
                 parallel={"dp": 2, "pp": 2, "shard_optimizer": shard}, checkpoint={"verify_restores": True})
    result = Trainer(cfg, verbose=False,
                     on_step=Chaos().at(4, lambda: c.remove_node(node_of_rank(name, 3, nodes), allow_graceful=False))).fit()
    assert_contiguous_data(result, cfg)
    assert result.plans[0]["shard_optimizer"] == ("none" if case == "adafactor" else "gradients")
    [rec] = result.recoveries
    check = rec["restore_check"]
    assert check["differ"] == [] and check["unverified"] == 0 and check["tensors"] > 0, check
    # Before the loss the 2 x 2 run is single-process torch's; after it, the survivors' sum of
    # the same gradients in another order, as in test_recovery.
    ref = reference_losses(cfg, cfg.train.steps)
    change = rec["failed_step"]
    got = [r["loss"] for r in result.history]
    assert got[:change - 1] == pytest.approx(ref[:change - 1], rel=1e-5)
    assert got[change - 1:] == pytest.approx(ref[change - 1:], rel=1e-3)

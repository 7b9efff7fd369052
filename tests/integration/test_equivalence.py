"""Per-step losses and final weights of a run through Ray match plain single-process torch.

Every layout, schedule, all-reduce algorithm and optimizer sharding is checked against the same
reference on the ranks' own code in ``tests/unit/test_layouts_match_torch.py`` (one spawn of four
gloo processes for all of them); here a run goes through the whole system:
the controller's plan, the workers it places, the history and the weights it gathers.
"""

import pytest
import torch

from elastic_trainer import Trainer, TrainerConfig

from ..conftest import tiny_config
from ..helpers import reference_run

pytestmark = pytest.mark.integration
STEPS = 5


@pytest.fixture(scope="module")
def reference(corpus_dir):
    """Plain torch: one process, the whole global batch at once, the same blocks and seed."""
    return reference_run(TrainerConfig.from_dict(tiny_config(corpus_dir)), STEPS)


@pytest.mark.timeout(240)
def test_matches_single_process(cluster, corpus_dir, reference):
    ref_losses, ref_state = reference
    shard = "none"   # sharded runs through Ray: tests/integration/test_sharded_runs.py
    cfg = TrainerConfig.from_dict(tiny_config(corpus_dir, parallel={"dp": 2, "pp": 2, "shard_optimizer": shard}))
    result = Trainer(cfg, verbose=False).fit(return_model_state=True)

    losses = [r["loss"] for r in result.history]
    assert [r["step"] for r in result.history] == list(range(1, STEPS + 1))
    assert all((r["dp"], r["pp"], r["world_size"]) == (2, 2, 4) for r in result.history)
    assert result.plan["shard_optimizer"] == shard
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert losses[-1] < losses[0]

    state = result.model_state
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")

"""Per-step losses and final weights of every dp x pp layout match plain single-process torch."""

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


# Every schedule at dp=2 x pp=2; pipelines alone at pp=2 and pp=4 on 1F1B. (At 8-12 s a run,
# mostly its workers' start, each schedule at every pipeline depth cost 30 s more and showed
# nothing these do not.)
LAYOUTS = [
    (1, 1, "1f1b"), (2, 1, "1f1b"), (4, 1, "1f1b"),  # pp=1 runs no pipeline schedule
    (1, 2, "1f1b"), (1, 4, "1f1b"),
    *[(2, 2, s) for s in ("gpipe", "1f1b", "interleaved")],
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dp, pp, schedule", LAYOUTS, ids=[f"{d}x{p}-{s}" for d, p, s in LAYOUTS])
def test_matches_single_process(cluster, corpus_dir, reference, dp, pp, schedule):
    ref_losses, ref_state = reference
    cfg = TrainerConfig.from_dict(tiny_config(corpus_dir, parallel={"dp": dp, "pp": pp, "schedule": schedule}))
    result = Trainer(cfg, verbose=False).fit(return_model_state=True)

    losses = [r["loss"] for r in result.history]
    assert [r["step"] for r in result.history] == list(range(1, STEPS + 1))
    assert all((r["dp"], r["pp"], r["world_size"]) == (dp, pp, dp * pp) for r in result.history)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert losses[-1] < losses[0]

    state = result.model_state
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


COMM_VARIANTS = [("tree", True), ("chunked", True), ("ring", False)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("algorithm, overlap", COMM_VARIANTS, ids=[f"{a}-overlap{o}" for a, o in COMM_VARIANTS])
def test_own_all_reduce_algorithms_and_no_overlap_match_single_process(cluster, corpus_dir, reference,
                                                                        algorithm, overlap):
    ref_losses, ref_state = reference
    cfg = TrainerConfig.from_dict(tiny_config(corpus_dir, parallel={"dp": 2, "pp": 2},
                                              comm={"algorithm": algorithm, "overlap": overlap}))
    result = Trainer(cfg, verbose=False).fit(return_model_state=True)
    assert [r["loss"] for r in result.history] == pytest.approx(ref_losses, rel=1e-5)
    for name, ref in ref_state.items():
        torch.testing.assert_close(result.model_state[name], ref, rtol=1e-4, atol=1e-5)


# ZeRO-1 and ZeRO-2 at each DP-sharded layout the issue names (dp=2 x pp=2 on 1F1B and
# interleaved, dp=4 x pp=1).
SHARDED = [(2, 2, "1f1b", "optimizer"), (4, 1, "1f1b", "optimizer"), (2, 2, "interleaved", "optimizer"),
           (2, 2, "1f1b", "gradients"), (4, 1, "1f1b", "gradients"), (2, 2, "interleaved", "gradients")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dp, pp, schedule, shard", SHARDED, ids=[f"{s}-{d}x{p}-{sc}" for d, p, sc, s in SHARDED])
def test_sharded_optimizer_matches_single_process(cluster, corpus_dir, reference, dp, pp, schedule, shard):
    ref_losses, ref_state = reference
    cfg = TrainerConfig.from_dict(tiny_config(corpus_dir, parallel={"dp": dp, "pp": pp, "schedule": schedule,
                                                                     "shard_optimizer": shard}))
    result = Trainer(cfg, verbose=False).fit(return_model_state=True)
    assert [r["loss"] for r in result.history] == pytest.approx(ref_losses, rel=1e-5)
    for name, ref in ref_state.items():
        torch.testing.assert_close(result.model_state[name], ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")

"""Each optimizer's ranks at dp=2 x pp=2, sharded where it can be, step as plain single-process torch
with the same optimizer does (losses to 1e-5, weights to 1e-4).

As ``test_layouts_match_torch`` (whose reference and process machinery this follows): one spawn of
four gloo processes running ``StageTrainer``, the code every Ray worker steps with, for all cases.
Through Ray and a node loss: ``tests/integration/test_optimizer_runs.py``.
"""

import pytest

from elastic_trainer.config import TrainerConfig

from ..conftest import tiny_config
from ..helpers import assert_ranks_match, reference_run, spawn_rank_cases

STEPS = 5
PROCS = 4
NO_DECAY = [{"match": "*.bias", "weight_decay": 0.0}, {"regex": r"\.ln", "weight_decay": 0.0, "lr": 5e-4}]

# (train.optimizer, parallel.shard_optimizer)
CASES = [
    ({"name": "SGD", "kwargs": {"momentum": 0.9, "nesterov": True}}, "optimizer"),
    ({"name": "Adam", "kwargs": {"amsgrad": True, "foreach": True}}, "none"),   # AdamW's foreach kernel too
    ({"name": "AdamW", "kwargs": {"fused": True}, "param_groups": NO_DECAY}, "gradients"),
    ({"name": "Adafactor"}, "none"),
    ({"name": "tests.optim_lion:Lion", "kwargs": {"weight_decay": 0.1}, "param_groups": NO_DECAY}, "gradients"),
]
IDS = [f"{o['name'].split(':')[-1]}{sorted(o.get('kwargs', {}))}-{shard}" for o, shard in CASES]


def _cfg(corpus, optimizer, shard, dp=2, pp=2):
    return TrainerConfig.from_dict(tiny_config(
        corpus, train={"optimizer": optimizer},
        parallel={"dp": dp, "pp": pp, "shard_optimizer": shard if dp > 1 else "none"},
        run={"output_dir": None}, comm={"timeout_s": 60}))


def _rank(rank, ports, corpus, q):
    import torch

    torch.set_num_threads(1)   # as a Ray worker of one CPU runs: four processes share two cores

    from elastic_trainer.parallel.topology import Topology
    from elastic_trainer.planning.plan import make_plan
    from elastic_trainer.worker.process_group import destroy_groups, init_groups
    from elastic_trainer.worker.stage import StageTrainer

    for i, (optimizer, shard) in enumerate(CASES):
        try:
            cfg = _cfg(corpus, optimizer, shard)
            topo = Topology(2, 2)
            groups = init_groups("gloo", "127.0.0.1", ports[i], topo, rank, timeout_s=60)
            t = StageTrainer(cfg, topo, rank, groups, make_plan(cfg).stage_bounds, torch.device("cpu"))
            assert (t.zero is not None) == (shard != "none")
            losses = [t.train_step(step).loss for step in range(1, STEPS + 1)]
            state = {n: w.numpy() for n, w in t.state_dict().items()} if t.replica == 0 else {}
            q.put((i, rank, "ok", (losses, state)))
            t.close()
            destroy_groups()
        except Exception:  # noqa: BLE001 - reported to the test
            import traceback

            q.put((i, rank, "error", traceback.format_exc()))
            return


@pytest.fixture(scope="module")
def runs(corpus_dir):
    return spawn_rank_cases(_rank, PROCS, len(CASES), len(CASES) * PROCS, corpus_dir)


@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_optimizer_at_2x2_matches_single_process(runs, corpus_dir, i):
    reference = reference_run(_cfg(corpus_dir, CASES[i][0], "none", dp=1, pp=1), STEPS)
    assert_ranks_match(runs.get(i, {}), PROCS, 2, reference)

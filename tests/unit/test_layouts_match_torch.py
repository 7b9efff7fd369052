"""Every dp x pp layout's ranks, sharded or not, step as plain single-process torch does.

Four gloo processes run the ranks of each layout in turn (``StageTrainer``, the code every Ray
worker runs its steps with), five steps each; losses must match the single-process reference to
1e-5 and final weights to 1e-4. One spawn for all layouts: a Ray run of each cost 7-8 s, most of
it its workers' start (``tests/integration/test_equivalence.py`` keeps the runs through Ray).
"""

import pytest

from elastic_trainer.config import TrainerConfig

from ..conftest import tiny_config
from ..helpers import assert_ranks_match, reference_run, spawn_rank_cases

STEPS = 5
PROCS = 4

# (dp, pp, schedule, parallel.shard_optimizer, comm overrides)
LAYOUTS = [
    (1, 1, "1f1b", "none", {}), (2, 1, "1f1b", "none", {}), (4, 1, "1f1b", "none", {}),
    (1, 2, "1f1b", "none", {}), (1, 4, "1f1b", "none", {}),
    (2, 2, "gpipe", "none", {}), (2, 2, "interleaved", "none", {}),
    # Own all-reduce algorithms, and no overlap.
    (2, 2, "1f1b", "none", {"algorithm": "tree"}), (2, 2, "1f1b", "none", {"algorithm": "chunked"}),
    (2, 2, "1f1b", "none", {"overlap": False}),
    # ZeRO-1 and ZeRO-2 at 2 x 2 (1F1B and interleaved) and 4 x 1.
    *[(dp, pp, s, shard, {}) for shard in ("optimizer", "gradients")
      for dp, pp, s in ((2, 2, "1f1b"), (4, 1, "1f1b"), (2, 2, "interleaved"))],
    (2, 2, "1f1b", "gradients", {"overlap": False}),
]
IDS = [f"{dp}x{pp}-{s}-{shard}" + "".join(f"-{k}={v}" for k, v in c.items()) for dp, pp, s, shard, c in LAYOUTS]


def _cfg(corpus, dp, pp, schedule, shard, comm):
    return TrainerConfig.from_dict(tiny_config(corpus, parallel={"dp": dp, "pp": pp, "schedule": schedule,
                                                                 "shard_optimizer": shard},
                                               run={"output_dir": None}, comm={"timeout_s": 60, **comm}))


def _rank(rank, ports, corpus, q):
    import torch

    torch.set_num_threads(1)   # as a Ray worker of one CPU runs: four processes share two cores

    from elastic_trainer.parallel.topology import Topology
    from elastic_trainer.planning.plan import make_plan
    from elastic_trainer.worker.process_group import destroy_groups, init_groups
    from elastic_trainer.worker.stage import StageTrainer

    for i, (dp, pp, schedule, shard, comm) in enumerate(LAYOUTS):
        if rank >= dp * pp:
            continue
        try:
            cfg = _cfg(corpus, dp, pp, schedule, shard, comm)
            topo = Topology(dp, pp)
            groups = init_groups("gloo", "127.0.0.1", ports[i], topo, rank, timeout_s=60)
            t = StageTrainer(cfg, topo, rank, groups, make_plan(cfg).stage_bounds, torch.device("cpu"))
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
    return spawn_rank_cases(_rank, PROCS, len(LAYOUTS), sum(dp * pp for dp, pp, *_ in LAYOUTS), corpus_dir)


@pytest.fixture(scope="module")
def reference(corpus_dir):
    return reference_run(_cfg(corpus_dir, 1, 1, "1f1b", "none", {}), STEPS)


@pytest.mark.parametrize("i", range(len(LAYOUTS)), ids=IDS)
def test_layout_matches_single_process(runs, reference, i):
    dp, pp, *_ = LAYOUTS[i]
    # The last stage's ranks hold the loss of their replica's micro-batches: the step's is their mean.
    assert_ranks_match(runs.get(i, {}), dp * pp, dp, reference)

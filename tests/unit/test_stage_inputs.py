"""One read per batch: the first stage reads, the last stage gets the targets with a windows
fingerprint; two stages that disagree on a step's windows fail at once. Two gloo processes."""

import numpy as np
import torch

from elastic_trainer.config import TrainerConfig
from elastic_trainer.parallel.topology import Topology

from ..conftest import tiny_config
from ..helpers import spawn_ranks


def _rank(rank, port, corpus, steps_of_rank, q):
    steps = steps_of_rank[rank]
    from elastic_trainer.worker.inputs import StageInputs
    from elastic_trainer.worker.process_group import destroy_groups, init_groups

    try:
        # No output folder: this child saves nothing, and would leave an empty one behind.
        cfg = TrainerConfig.from_dict(tiny_config(corpus, parallel={"dp": 1, "pp": 2}, run={"output_dir": None}))
        topo = Topology(1, 2)
        groups = init_groups("gloo", "127.0.0.1", port, topo, rank, timeout_s=20)
        inputs = StageInputs(cfg, topo, 0, rank == 0, rank == 1, groups.pp, torch.device("cpu"))
        out = []
        for step in steps:
            x, y = inputs.train_batch(step)
            out.append((x if rank == 0 else y).numpy())
        inputs.close()
        destroy_groups()
        q.put((rank, "ok", out))
    except Exception as e:  # noqa: BLE001 - reported to the test
        q.put((rank, "error", f"{type(e).__name__}: {e}"))


def _run(corpus, steps_of_rank):
    return spawn_ranks(_rank, 2, corpus, steps_of_rank)


def test_last_stage_gets_the_first_stages_targets(corpus_dir):
    got = _run(corpus_dir, {0: [1, 2], 1: [1, 2]})
    assert got[0][0] == got[1][0] == "ok", got
    for x, y in zip(got[0][1], got[1][1]):
        # Targets are the inputs shifted by one token: one read made both.
        assert np.array_equal(x[:, 1:], y[:, :-1])


def test_stages_reading_different_steps_fail_clearly(corpus_dir):
    got = _run(corpus_dir, {0: [1], 1: [2]})
    assert got[1][0] == "error", got
    assert "the two stages read different windows" in got[1][1]

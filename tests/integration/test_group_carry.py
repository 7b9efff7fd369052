"""A re-plan carries the process groups that stay the same (gloo, ``failure.keep_groups``)."""

import pytest

from elastic_trainer import Trainer
from elastic_trainer.chaos.simulate import freeze_node, kill_pids

from ..helpers import reference_losses
from .test_recovery import Chaos, assert_contiguous_data, config, node_of_rank, status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# The memory given each worker holds half the model, not all of it: the re-plan stays 2 x 2.
PAIRS = {"workers_per_node": 2, "replica_placement": "spread", "resources_per_worker": {"CPU": 0.5},
         "worker_memory_gb": 0.0016}


@pytest.mark.parametrize("loss", ["kill", "freeze"])
def test_a_replica_lost_whole_leaves_the_surviving_pipeline_its_group(fresh_cluster, corpus_dir, loss):
    # Two one-CPU nodes of two workers: replica 0 on one, replica 1 on the other. The node is
    # killed (seen as a death, or as silence where the heartbeat comes first) or frozen whole
    # (SIGSTOP: no socket closes, only the heartbeat tells); either way the settle round cuts
    # just the groups the lost replica was in.
    c, nodes = fresh_cluster(2)
    name = f"carry-{loss}"
    cfg = config(corpus_dir, name, parallel={"dp": 2, "pp": 2}, scaling=PAIRS)
    seen, frozen, lost = {}, [], []

    def lose():
        seen.update({w["rank"]: w["worker_id"] for w in status(name)["workers"] if w["rank"] is not None})
        node = node_of_rank(name, 3, nodes)
        lost.append(node)
        if loss == "freeze":
            frozen.extend(freeze_node(node))
        else:
            c.remove_node(node, allow_graceful=False)

    try:
        result = Trainer(cfg, verbose=False, on_step=Chaos().at(4, lose)).fit()
    finally:
        kill_pids(frozen)
        if loss == "freeze":
            for node in lost:
                c.remove_node(node, allow_graceful=False)

    assert_contiguous_data(result, cfg)
    [rec] = result.recoveries
    if loss == "freeze":
        assert rec["reason"] == "silent", rec
    assert (rec["plan_after"]["dp"], rec["plan_after"]["pp"]) == (1, 2)
    after = {w["rank"]: w["worker_id"] for w in result.workers if w["rank"] is not None}
    assert (after[0], after[1]) == (seen[0], seen[1])
    # Replica 0's pipeline group is whole (neither rank waits in it when the dead replica's
    # all-reduce fails): carried. The two one-rank DP groups are new.
    assert (rec["groups_carried"], rec["groups_built"]) == (1, 2), rec
    ref = reference_losses(cfg, cfg.train.steps)
    assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-4)

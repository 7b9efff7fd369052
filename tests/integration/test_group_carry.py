"""A re-plan carries the process groups that stay the same (gloo, ``failure.keep_groups``)."""

import json
import time

import pytest
import ray

from elastic_trainer import Trainer
from elastic_trainer.naming import NAMESPACE
from elastic_trainer.chaos.simulate import freeze_node, kill_pids, process_tree

from ..helpers import reference_losses
from .test_recovery import Chaos, assert_contiguous_data, config, node_of_rank, status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# The memory given each worker holds half the model, not all of it (0.3936 GiB as 2 x 2, 0.3954 as
# one stage, most of it the process itself): the re-plan stays 2 x 2.
PAIRS = {"workers_per_node": 2, "replica_placement": "spread", "resources_per_worker": {"CPU": 0.5},
         "worker_memory_gb": 0.394}


def worker(name, rank):
    return ray.get_actor(f"{name}-rank{rank}-r{rank // 2}s{rank % 2}", namespace=NAMESPACE)


def slow_down_replica_1(name):
    # Replica 1 computes 20x slower (a sleep: the numbers stay), so replica 0 spends most of each
    # step waiting for it in the gradients' all-reduce: the window the loss is made to land in.
    ray.get([worker(name, r).inject_fault.remote("slow_compute", seconds=20.0) for r in (2, 3)])


def await_replica_0_in_its_all_reduce(name):
    # The loss lands where the test means it to: both of replica 0's ranks have ended their
    # pipeline's part of the step and wait in the DP all-reduce. A loss a moment earlier can find
    # stage 1 past its all-reduce and waiting for stage 0 in the gradient norm's: then the
    # pipeline group is not whole, rightly built again, and not what this test is about.
    survivors = [worker(name, r) for r in (0, 1)]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        states = ray.get([a.group_state.remote() for a in survivors])
        if all(s["busy"] and s.get("waiting") == "dp" for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"replica 0 never waited in its all-reduce: {states}")


@pytest.mark.parametrize("loss", ["kill", "freeze"])
def test_a_replica_lost_whole_leaves_the_surviving_pipeline_its_group(fresh_cluster, corpus_dir, loss):
    # Two one-CPU nodes of two workers: replica 0 on one, replica 1 on the other. The node is
    # killed (seen as a death, or as silence where the heartbeat comes first) or frozen whole
    # (SIGSTOP: no socket closes, only the heartbeat tells) while replica 0 waits for it in the
    # all-reduce; either way the settle round cuts just the groups the lost replica was in.
    c, nodes = fresh_cluster(2)
    name = f"carry-{loss}"
    # Balancing off: the slowed replica is the test's clock, not a straggler to move work off.
    # Sharding off: sharded, one stage would fit the bound too (parallel.shard_optimizer auto).
    cfg = config(corpus_dir, name, parallel={"dp": 2, "pp": 2, "shard_optimizer": "none"}, scaling=PAIRS,
                 balance={"mode": "off"})
    seen, frozen, lost = {}, [], []

    def lose():
        # Who is where, read first: two status calls between the wait below and the loss took
        # long enough on a loaded CI machine for replica 1 to reach its all-reduce meanwhile, and
        # the loss then found stage 1 in the next collective (groups_carried 0).
        seen.update({w["rank"]: w["worker_id"] for w in status(name)["workers"] if w["rank"] is not None})
        node = node_of_rank(name, 3, nodes)
        await_replica_0_in_its_all_reduce(name)
        lost.append(node)
        if loss == "freeze":
            frozen.extend(freeze_node(node))
        else:
            # The machine, whole and at once: remove_node alone ends the node's processes one
            # after another, and a rank that outlived its peer by a moment (CI: rank 2, by
            # 0.2 s) was rightly taken for a survivor, its death then failing the new plan's set-up.
            kill_pids(process_tree(node.all_processes["raylet"][0].process.pid))
            c.remove_node(node, allow_graceful=False)

    try:
        result = Trainer(cfg, verbose=False, on_step=Chaos().at(2, lambda: slow_down_replica_1(name)).at(4, lose)).fit()
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
    assert (rec["groups_carried"], rec["groups_built"]) == (1, 2), json.dumps(rec.to_dict(), default=str)
    ref = reference_losses(cfg, cfg.train.steps)
    assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-4)

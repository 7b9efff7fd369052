"""Preemption notices: a node drained through Ray's GCS (``DrainNode`` with reason PREEMPTION and
a deadline, as ``ray drain-node`` issues it) is left before its deadline, and the node is then
killed at the deadline as a cloud would. Nothing is redone, no failure is counted, and with a
spare node the layout stays."""

import threading
import time

import pytest
import ray

from elastic_trainer.chaos.simulate import drain_node

from ..helpers import reference_losses
from .test_recovery import Chaos, assert_contiguous_data, config, node_of_rank

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def drain(cluster, node, deadline_s: float | None) -> None:
    """Ray's own drain of ``node``: a preemption notice with ``deadline_s`` seconds left."""
    drain_node(node.node_id, deadline_s, "preempted (test)", address=cluster.address)


def test_a_drained_node_is_left_before_its_deadline_with_nothing_redone(fresh_cluster, corpus_dir):
    c, nodes = fresh_cluster(5)   # four ranks and a spare
    # Steps long enough that the run outlives the deadline (a run that ends first loses nothing either).
    cfg = config(corpus_dir, "drain1", steps=300, parallel={"dp": 2, "pp": 2}, checkpoint={"memory_every": 25})
    killed = threading.Event()
    victim, leaving = [], set()

    def notice():
        node = node_of_rank("drain1", 3, nodes)
        st = ray.get(ray.get_actor("drain1-controller", namespace="elastic_trainer").status.remote())
        victim.append(node)
        leaving.update(w["worker_id"] for w in st["workers"] if w["node_id"] == node.node_id)
        drain(c, node, 20.0)

        def at_deadline():
            time.sleep(20.0)   # the cloud takes the node at its deadline, whatever the run did
            c.remove_node(node, allow_graceful=False)
            killed.set()
        threading.Thread(target=at_deadline, daemon=True).start()

    from elastic_trainer import Trainer

    result = Trainer(cfg, verbose=False, on_step=Chaos().at(5, notice)).fit()
    assert killed.wait(30)
    assert_contiguous_data(result, cfg)
    assert result.failures == [], result.failures
    [rec] = result.recoveries
    assert rec["reason"] == "drain" and rec["restored_step"] == rec["failed_step"] - 1, rec
    assert rec["plan_after"]["world_size"] == 4, rec   # the spare took the leaving rank
    drains = [e for e in result.events if e["kind"] == "drain"]
    assert drains[0]["node"] == victim[0].node_id and drains[0]["ranks"] == [3], drains
    assert 0 < drains[0]["left_s"] <= 20.0 and drains[0]["outcome"] == "moved", drains
    assert leaving and not leaving & set(result.plans[-1]["workers"].values()), (leaving, result.plans[-1])
    ref = reference_losses(cfg, cfg.train.steps)
    assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-3)


def test_a_notice_too_short_to_move_in_snapshots_first_and_takes_the_loss_at_the_deadline(fresh_cluster,
                                                                                            corpus_dir):
    from elastic_trainer import Trainer

    c, nodes = fresh_cluster(5)
    cfg = config(corpus_dir, "drain3", steps=300, parallel={"dp": 2, "pp": 2}, checkpoint={"memory_every": 25})
    victim, killed = [], threading.Event()

    def notice():
        victim.append(node_of_rank("drain3", 3, nodes))
        deadline = time.time() + 1.0   # a second's notice: too short to move a rank in
        drain(c, victim[0], 1.0)

        def at_deadline():
            ctl = ray.get_actor("drain3-controller", namespace="elastic_trainer")
            while not [e for e in ray.get(ctl.progress.remote(0, 0))["events"] if e["kind"] == "drain"]:
                time.sleep(0.05)   # the cloud's kill comes once the run has read the notice
            time.sleep(max(0.0, deadline - time.time()))
            c.remove_node(victim[0], allow_graceful=False)
            killed.set()
        threading.Thread(target=at_deadline, daemon=True).start()

    result = Trainer(cfg, verbose=False, on_step=Chaos().at(5, notice)).fit()
    assert killed.wait(30)
    assert_contiguous_data(result, cfg)
    [ev] = [e for e in result.events if e["kind"] == "drain" and e.get("node") == victim[0].node_id][:1]
    assert ev["outcome"] == "loss" and "then the loss path at the deadline" in ev["action"], ev
    # The loss path at the deadline, and the loss named as a drain's.
    [failure] = result.failures
    assert failure["node"] == victim[0].node_id and "draining" in failure["drain"], failure
    assert result.recoveries[0]["reason"] == failure["failure"], result.recoveries


def test_a_node_that_outlives_a_short_notice_loses_nothing_and_is_then_moved_off(fresh_cluster, corpus_dir):
    from elastic_trainer import Trainer

    c, nodes = fresh_cluster(5)
    cfg = config(corpus_dir, "drain4", steps=300, parallel={"dp": 2, "pp": 2}, checkpoint={"memory_every": 25})
    victim, leaving = [], set()

    def notice():
        victim.append(node_of_rank("drain4", 3, nodes))
        st = ray.get(ray.get_actor("drain4-controller", namespace="elastic_trainer").status.remote())
        leaving.update(w["worker_id"] for w in st["workers"] if w["node_id"] == victim[0].node_id)
        drain(c, victim[0], 1.0)   # too short to move in, and the cloud never comes for it

    try:
        result = Trainer(cfg, verbose=False, on_step=Chaos().at(5, notice)).fit()
    finally:
        if victim:
            c.remove_node(victim[0], allow_graceful=False)   # a draining node takes no later test's work
    assert_contiguous_data(result, cfg)
    assert result.failures == [], result.failures
    evs = [e for e in result.events if e["kind"] == "drain" and e.get("node") == victim[0].node_id and "outcome" in e]
    assert [e["outcome"] for e in evs][:2] == ["loss", "moved"] and "outlived" in evs[1]["action"], evs
    # The move off it redoes nothing (a later grow or re-balance may re-plan again, redoing nothing either).
    moves = [r for r in result.recoveries if r["reason"] == "drain"]
    assert moves and moves[0]["restored_step"] == moves[0]["failed_step"] - 1, result.recoveries
    assert sum(r["steps_redone"] for r in result.recoveries) == 0, result.recoveries
    assert leaving and not leaving & set(result.plans[-1]["workers"].values()), (leaving, result.plans[-1])
    ref = reference_losses(cfg, cfg.train.steps)
    assert [r["loss"] for r in result.history] == pytest.approx(ref, rel=1e-3)


@ray.remote(num_cpus=0)
class _Tenant:
    """Another program's actor on the node: a node with nothing running on it would leave at once."""

    def ping(self):
        return True


def test_a_drain_of_a_node_without_a_rank_costs_nothing(fresh_cluster, corpus_dir):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from elastic_trainer import Trainer

    c, nodes = fresh_cluster(5)
    cfg = config(corpus_dir, "drain2", steps=120, parallel={"dp": 2, "pp": 2})
    spare, tenant = [], []

    def notice():
        st = ray.get(ray.get_actor("drain2-controller", namespace="elastic_trainer").status.remote())
        used = {w["node_id"] for w in st["workers"] if w["rank"] is not None}
        spare.append(next(n for n in nodes if n.node_id not in used))
        tenant.append(_Tenant.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            spare[0].node_id, soft=False)).remote())
        ray.get(tenant[0].ping.remote())
        drain(c, spare[0], 30.0)

    try:
        result = Trainer(cfg, verbose=False, on_step=Chaos().at(4, notice)).fit()
    finally:
        for t in tenant:
            ray.kill(t)
        if spare:
            c.remove_node(spare[0], allow_graceful=False)   # a draining node takes no later test's work
    assert_contiguous_data(result, cfg)
    assert result.failures == [] and result.recoveries == [], (result.failures, result.recoveries)
    [ev] = [e for e in result.events if e["kind"] == "drain" and e.get("node") == spare[0].node_id][:1]
    assert ev["ranks"] == [] and ev["action"].startswith("nothing to move") and ev["outcome"] == "idle", ev

"""The restore after a node loss whose survivors were dropped for staying inside the failed step.

The state of a CI failure (parameter-server mode, dp=2 x pp=2, eight blocks, a snapshot
every step): rank 3's node died at step 6; ranks 0 and 1 stayed inside the failed step
and were dropped, though they still answered; rank 2 survived with its own stage's copies
of steps 3-5. The step-4 snapshot's stage-1 part was written by rank 1, on its node, which
lives: the run restores step 4 from it instead of ending with "no source".
"""

import pytest

from elastic_trainer import TrainerConfig
from elastic_trainer.controller.state.restore import choose_restore, newest_copies
from elastic_trainer.controller.state.snapshot_parts import ShardEntry, Snapshot
from elastic_trainer.controller.state.snapshots import SnapshotStore
from elastic_trainer.controller.run.workers import WorkerHandle, WorkerPool

from ..conftest import tiny_config

STAGE0, STAGE1 = [0, 1, 2, 3], [4, 5, 6, 7]


def _pool():
    pool = WorkerPool(TrainerConfig.from_dict(tiny_config("/nonexistent", parallel={"dp": 2, "pp": 2})), "psl")
    # Worker w holds rank w, on its own node.
    pool.workers = {w: WorkerHandle(w, None, f"node{w}", pid=100 + w, ip="127.0.0.1", rank=w) for w in range(4)}
    return pool


def _store():
    """Snapshots of steps 4 and 5, committed; the stage writers take turns (put_phases)."""
    store = SnapshotStore(replicas=2, keep=3)
    store.snaps[4] = Snapshot(4, 0.0, {2: ShardEntry("s4r2", STAGE0, "node2", wid=2),
                                       1: ShardEntry("s4r1", STAGE1, "node1", wid=1)}, committed_at=1.0)
    store.snaps[5] = Snapshot(5, 0.0, {0: ShardEntry("s5r0", STAGE0, "node0", wid=0),
                                       3: ShardEntry("s5r3", STAGE1, "node3", wid=3)}, committed_at=2.0)
    return store


def _after_the_failure():
    pool, store = _pool(), _store()
    pool.drop([3])                       # its node died
    pool.drop([0, 1], answered=True)     # stayed inside step 6, still answered a ping
    live = {2: {3: STAGE0, 4: STAGE0, 5: STAGE0}}
    return pool, store, live


def test_a_part_on_the_node_of_a_worker_dropped_while_answering_still_restores():
    pool, store, live = _after_the_failure()
    assert pool.nodes() == {"node0", "node1", "node2"}
    snaps = store.available(pool.nodes(), set(pool.workers))
    # The PS kept the shards of steps 4 and 5, and is at step 5.
    found = choose_restore(8, live, snaps, {}, max_step=5, allowed={4, 5})
    assert found is not None
    step, chosen = found
    assert step == 4
    assert {chosen[b].tier for b in STAGE0} == {"live"} and chosen[0].worker == 2
    assert {(chosen[b].tier, chosen[b].part) for b in STAGE1} == {("snapshot", 1)}


def test_a_node_ray_declared_dead_no_longer_counts():
    pool, store, live = _after_the_failure()
    pool.forget_dead_nodes({"node1"})
    snaps = store.available(pool.nodes(), set(pool.workers))
    assert choose_restore(8, live, snaps, {}, max_step=5, allowed={4, 5}) is None


def test_a_worker_dropped_unanswering_takes_its_node_with_it():
    pool, store, live = _pool(), _store(), {2: {4: STAGE0, 5: STAGE0}}
    pool.drop([3])
    pool.drop([0, 1])
    assert pool.nodes() == {"node2"}
    assert choose_restore(8, live, store.available(pool.nodes(), set(pool.workers)), {}, max_step=5) is None


@pytest.mark.parametrize("allowed, want", [({4, 5}, 5), ({4}, 4), (set(), None)])
def test_the_restore_step_is_one_the_parameter_server_can_come_back_to(allowed, want):
    live = {2: {4: STAGE0, 5: STAGE0}, 3: {4: STAGE1, 5: STAGE1}}
    found = choose_restore(8, live, {}, {}, max_step=5, allowed=allowed)
    assert (found[0] if found else None) == want


def test_the_error_names_where_each_blocks_newest_copy_is():
    text = newest_copies(3, [(0, 5, "worker 2's copy", True),
                             (1, 5, "the snapshot part of rank 3 on node node3", False),
                             (1, 3, "durable shard 0", True),
                             (0, 4, "the snapshot part of rank 1 on node node1", True)])
    assert text == ("block 0: step 5 in worker 2's copy (reachable); "
                    "block 1: step 5 in the snapshot part of rank 3 on node node3 (lost); "
                    "newest reachable: step 3 in durable shard 0; "
                    "block 2: no copy")


def test_a_grow_under_a_sharded_optimizer_restores_the_step_just_ended_not_an_older_one():
    # ZeRO at dp=2 x pp=2: each rank's part of step 6 is a slice, in the object store, and the
    # snapshot has not committed yet (its pinned copies are still going out). Every writer lives:
    # a grow (no failure) restores step 6 from those parts. Before, a grow went ahead once step
    # 6's snapshot was taken, the restore saw only step 4 (committed) and redid steps 5 and 6;
    # with no committed snapshot at all and no storage, it ended the run.
    store = SnapshotStore(replicas=2, keep=3)
    group0, group1 = (0, 2), (1, 3)
    store.snaps[4] = Snapshot(4, 0.0, {r: ShardEntry(f"s4r{r}", STAGE0 if r % 2 == 0 else STAGE1, f"node{r}", wid=r,
                                                     sealed=True, group=group0 if r % 2 == 0 else group1)
                                       for r in range(4)}, committed_at=1.0)
    store.snaps[6] = Snapshot(6, 0.0, {r: ShardEntry(f"s6r{r}", STAGE0 if r % 2 == 0 else STAGE1, f"node{r}", wid=r,
                                                     sealed=True, group=group0 if r % 2 == 0 else group1)
                                       for r in range(4)})
    alive = {0, 1, 2, 3}
    snaps = store.available({f"node{r}" for r in range(4)}, alive)
    assert choose_restore(8, {}, snaps, {}, max_step=6)[0] == 4      # what a failure may use
    sealed = store.sealed_groups(6, alive)
    assert sealed == {group0: STAGE0, group1: STAGE1}
    snaps.setdefault(6, {}).update(sealed)
    step, chosen = choose_restore(8, {}, snaps, {}, max_step=6)
    assert step == 6 and {chosen[b].part for b in STAGE0} == {group0}
    # A writer gone, or a part not yet in the object store: its group is no source.
    assert store.sealed_groups(6, alive - {3}) == {group0: STAGE0}
    store.snaps[6].shards[2].sealed, store.snaps[6].shards[2].error = False, "lost"
    assert group0 not in store.sealed_groups(6, alive)


def test_a_loss_before_any_snapshot_committed_starts_again_from_the_seed_not_a_failed_run(monkeypatch):
    # Found by the fault campaign (seeds 179, 197, ZeRO-2): a worker killed in step 2, when the
    # snapshot of step 1 had not committed yet and no durable checkpoint was written. The run
    # failed ("no step up to 1 has a source for every block"), though the seed it began from is
    # always there: it starts again from it, its step run again.


    from elastic_trainer.controller.run.run_record import RunRecord
    from elastic_trainer.controller.state import restore_points as rp

    cfg = TrainerConfig.from_dict(tiny_config("/nonexistent", parallel={"dp": 2, "pp": 2}))
    run = RunRecord(cfg, "early")
    run.counts, run.step = [1] * 8, 1
    pool = _pool()
    pool.ask = lambda method, wids, timeout, *args: {w: {} for w in wids}
    monkeypatch.setattr(rp, "dead_nodes", lambda: set())
    points = rp.RestorePoints(cfg, {}, {}, run, pool, SnapshotStore(replicas=2, keep=3), None, lambda: None)
    assert points.restore_point() is None
    [ev] = [e for e in run.events if e["kind"] == "checkpoint_problem"]
    assert "starts again from its seed" in ev["detail"]
    # A resumed run did not begin from the seed: with no source left it stops, saying why.
    points.resume_point = (5, {}, {"durable": 8})
    with pytest.raises(rp.RunError, match="no step up to 1 has a source for every block"):
        points.restore_point()


"""When an object-store snapshot commits, what a rollback leaves of it, and what a pin answered late can do.

These drive ``SnapshotStore`` with a real local Ray: the parts are real objects (sealed, or held back
by an actor until the test lets them go) and the pin holders keep their copies in a real
``HeldCopies``, as ``TrainWorker.pin`` does.
"""

import threading

import pytest
import ray

from elastic_trainer.controller.state.snapshots import SnapshotStore
from elastic_trainer.controller.run.workers import WorkerHandle
from elastic_trainer.parallel.topology import Topology
from elastic_trainer.planning.plan import Plan
from elastic_trainer.worker.copies import HeldCopies


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    if ray.is_initialized():
        yield   # an earlier test's (a first Ray call starts one): these actors need no CPU of it
        return
    # address="local": a Ray of its own, never a cluster another test left running.
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


@ray.remote(num_cpus=0, max_concurrency=4)
class Holder:
    """A pin holder as ``TrainWorker.pin`` is (its copies in ``HeldCopies``); a part marked ``hold``
    is stored only once ``release`` is called: a pin that answers late."""

    def __init__(self):
        self.copies = HeldCopies()
        self.gate = threading.Event()

    def pin(self, key, refs, keep_from):
        part = ray.get(refs[0])
        if part.get("hold"):
            self.gate.wait()
        return self.copies.pin(key, part, keep_from)

    def release(self):
        self.gate.set()

    def pinned_part(self, key):
        return self.copies.pinned(tuple(key))


@ray.remote(num_cpus=0, max_concurrency=2)
class Producer:
    """A snapshot part that is not there until ``finish``: what a writer's ``snapshot_part`` is while its
    copy runs; ``fail`` makes it end in an error instead."""

    def __init__(self):
        self.done = threading.Event()
        self.error = False

    def part(self, blocks):
        self.done.wait()
        if self.error:
            raise RuntimeError("the snapshot's copy failed")
        return {"blocks": blocks}

    def finish(self, error=False):
        self.error = error
        self.done.set()


def _sealed(*refs):
    """Until the parts are in the object store (waiting on them, not on a clock)."""
    ray.wait(list(refs), num_returns=len(refs), fetch_local=False)


def test_a_pin_answered_late_for_a_step_taken_again_is_harmless():
    # dp=1: rank 0's part (on nodeA) gets its second copy from a pin on another node.
    holders = {11: Holder.remote(), 12: Holder.remote()}
    workers = [(10, None, "nodeA"), (11, holders[11], "nodeB"), (12, holders[12], "nodeC")]
    store = SnapshotStore(replicas=2, keep=2)
    old = ray.put({"v": "old", "hold": True})
    store.take(5, {0: (10, "nodeA", old, [0])}, workers, {})
    [(first_holder, old_ack)] = store.snaps[5].shards[0].pins.items()
    # The run rolled back to step 4 and took step 5 again while that pin was still being stored.
    new = ray.put({"v": "new"})
    store.take(5, {0: (10, "nodeA", new, [0])}, workers, {})
    entry = store.snaps[5].shards[0]
    _sealed(*entry.pins.values())
    assert [s.step for s in store.poll()] == [5] and entry.ref == new
    # Now the old pin stores its part: it neither counts for the new take nor drops it, and the copy
    # a restore would read when nodeA is gone is the new one.
    ray.get(holders[first_holder].release.remote())
    ray.wait([old_ack])
    assert store.poll() == [] and store.take_dropped() == [] and store.committed_steps() == [5]
    holder = store.live_holder(5, 0, {"nodeB", "nodeC"}, {11, 12})
    assert holder is not None and ray.get(holders[holder].pinned_part.remote((5, 0)))["v"] == "new"


def test_a_rollback_lets_go_of_the_later_snapshots_so_pruning_keeps_the_new_ones():
    store = SnapshotStore(replicas=1, keep=2)   # one copy: every part commits on its own object

    def take(step, value):
        ref = ray.put({"step": step, "v": value})
        store.take(step, {0: (10, "nodeA", ref, [0])}, [(10, None, "nodeA")], {})
        _sealed(ref)
        store.poll()
        store.prune()
        return ref

    for step in range(5, 11):
        take(step, "before")
    assert store.committed_steps() == [9, 10]
    # The run rolls back to step 6 (say, from the live copies) and takes steps 7 and 8 again.
    store.rolled_back(6)
    assert store.steps() == []
    new = {step: take(step, "after") for step in (7, 8)}
    assert store.committed_steps() == [7, 8]
    assert all(store.ref(step, 0) == ref for step, ref in new.items())


def _dp2(store):
    """A dp=2 plan of one stage (blocks 0 and 1) on two nodes; rank 0 writes the first snapshot."""
    store.set_plan(Plan(Topology(dp=2, pp=1), [(0, 2)], [100]))
    return {r: WorkerHandle(10 + r, None, f"node{r}", pid=0, ip="127.0.0.1") for r in (0, 1)}


def test_a_peers_local_copy_counts_only_once_the_peer_reports_it():
    store = SnapshotStore(replicas=2, keep=2)
    ranks = _dp2(store)
    part3 = ray.put({"blocks": [0, 1]})
    _sealed(part3)
    # Rank 1 is rank 0's DP peer on another node: two copies with no pin, if its copy exists.
    store.take_step(3, ranks, {10: part3, 11: None})
    assert store.poll() == [], "committed on no evidence that rank 1 holds a copy"
    alive = ({"node0", "node1"}, {10, 11})
    assert store.available(*alive) == {} and store.covering(3, 2, *alive) is None
    # The next snapshot step's results carry what each rank has copied since: rank 1, step 3.
    part4 = ray.put({"blocks": [0, 1]})
    store.take_step(4, ranks, {10: None, 11: part4}, results={10: {"copied": 3}, 11: {"copied": 3}})
    assert [s.step for s in store.poll()] == [3]
    assert store.available(*alive) == {3: {0: [0, 1]}} and store.covering(3, 2, *alive) == [part3]


def test_a_part_counts_once_its_object_is_sealed_and_a_failed_one_drops_its_snapshot():
    store = SnapshotStore(replicas=1, keep=2)
    good, bad = Producer.remote(), Producer.remote()
    part5, part6 = good.part.remote([0]), bad.part.remote([0])
    store.take(5, {0: (10, "nodeA", part5, [0])}, [(10, None, "nodeA")], {})
    assert store.poll() == [] and store.written({10}) == {}
    ray.get(good.finish.remote())
    _sealed(part5)
    assert store.written({10}) == {10: {5: (part5, [0])}}
    assert [s.step for s in store.poll()] == [5]
    store.take(6, {0: (10, "nodeA", part6, [0])}, [(10, None, "nodeA")], {})
    ray.get(bad.finish.remote(error=True))
    _sealed(part6)
    assert store.poll() == [] and store.written({10}) == {10: {5: (part5, [0])}}
    [dropped] = store.take_dropped()
    assert dropped.step == 6 and "rank 0's part" in dropped.dropped and store.steps() == [5]

"""How a stage's snapshot is shared among its DP replicas, and which parts restore a step."""

from elastic_trainer.checkpoint.state import select_blocks
from elastic_trainer.controller.state.snapshot_parts import ShardEntry, Snapshot, put_phases
from elastic_trainer.controller.state.snapshots import SnapshotStore
from elastic_trainer.parallel.topology import Topology


def test_one_replica_of_each_stage_writes_the_stage_in_turn():
    topo = Topology(dp=3, pp=2)
    blocks = {0: [0, 1, 2], 1: [3, 4]}
    phases = put_phases(topo, lambda rank: blocks[topo.coords(rank)[1]])
    assert len(phases) == 3
    for phase in phases:
        assert set(phase) == set(range(topo.world_size))
        writers = {r for r, b in phase.items() if b}
        # Every block written exactly once, by one replica per stage.
        assert sorted(b for bl in phase.values() for b in bl) == [0, 1, 2, 3, 4]
        assert sorted(topo.coords(r)[1] for r in writers) == [0, 1]
        # The two stages' writers are different replicas (so, with one rank per node, different nodes).
        assert len({topo.coords(r)[0] for r in writers}) == 2
    # Each rank writes in exactly one phase of dp.
    assert sorted(r for phase in phases for r, b in phase.items() if b) == list(range(topo.world_size))
    single = put_phases(Topology(dp=1, pp=2), lambda rank: [rank])
    assert single == [{0: [0], 1: [1]}]


def test_select_blocks_keeps_only_the_names_of_those_blocks():
    shard = {"step": 3, "blocks": [0, 1], "extra": {},
             "params": {"blocks.0.w": 1, "blocks.1.w": 2, "blocks.1.b": 3},
             "optim": {"blocks.0.w": {"exp_avg": 0}, "blocks.1.w": {"exp_avg": 1}}}
    part = select_blocks(shard, [1])
    assert part["blocks"] == [1] and set(part["params"]) == {"blocks.1.w", "blocks.1.b"}
    assert set(part["optim"]) == {"blocks.1.w"} and part["step"] == 3


def test_covering_needs_every_block_and_only_counts_parts_with_a_surviving_copy():
    store = SnapshotStore(replicas=2, keep=2)
    store.snaps[7] = Snapshot(7, 0.0, {
        0: ShardEntry("r0", [0, 1], "nodeA"),
        1: ShardEntry("r1", [2, 3], "nodeB", pinned={5}),
        2: ShardEntry("r2", [4], "nodeC"),
    }, committed_at=1.0)
    assert store.covering(7, 5) == ["r0", "r1", "r2"]
    assert store.covering(7, 6) is None
    assert store.covering(8, 5) is None
    # nodeB is gone but worker 5 holds a pinned copy of rank 1's part; nodeC is gone for good.
    assert store.covering(7, 5, alive_nodes={"nodeA"}, alive_workers={5}) is None
    assert store.covering(7, 4, alive_nodes={"nodeA"}, alive_workers={5}) == ["r0", "r1"]


def test_a_writers_part_counts_as_its_copy_only_while_the_writer_lives():
    store = SnapshotStore(replicas=2, keep=2)
    # Parts in the object store (sealed); one not yet there is named by no one (test_snapshot_commit).
    store.snaps[6] = Snapshot(6, 0.0, {0: ShardEntry("a6", [0, 1], "nodeA", wid=10, sealed=True),
                                       1: ShardEntry("b6", [2], "nodeB", wid=11, sealed=True)})
    store.snaps[7] = Snapshot(7, 0.0, {0: ShardEntry("a7", [0, 1], "nodeA", wid=12, sealed=True),
                                       1: ShardEntry("b7", [2], "nodeB", wid=11, sealed=True)})
    assert store.written({10, 11}) == {10: {6: ("a6", [0, 1])}, 11: {6: ("b6", [2]), 7: ("b7", [2])}}
    assert store.written(set()) == {}


def test_a_view_export_follows_the_live_tensors_and_a_copy_does_not():
    import torch

    from elastic_trainer.checkpoint.state import export_shard

    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.ones(1, 3)).sum().backward()
    opt.step()
    named = [("blocks.0.weight", lin.weight), ("blocks.0.bias", lin.bias)]
    view = export_shard(1, named, opt, [0], copy=False)
    copy = export_shard(1, named, opt, [0])
    before = lin.weight.detach().clone().numpy()
    with torch.no_grad():
        lin.weight.add_(1.0)
    opt.state[lin.weight]["exp_avg"].add_(1.0)
    assert (view["params"]["blocks.0.weight"] == lin.weight.detach().numpy()).all()
    assert (view["optim"]["blocks.0.weight"]["exp_avg"] == opt.state[lin.weight]["exp_avg"].numpy()).all()
    assert (copy["params"]["blocks.0.weight"] == before).all()


def test_a_worker_keeps_as_many_local_copies_as_the_controller_keeps_snapshots():
    from elastic_trainer.worker.copies import HeldCopies

    held = HeldCopies()
    held.keep = 2
    for step in (1, 2, 3):
        held.add_local(step, {"blocks": [0], "step": step})
    assert held.local_blocks() == {2: [0], 3: [0]}
    # Before the next copy is made, room for it: with it, never more than ``keep`` copies.
    held.make_room()
    assert held.local_blocks() == {3: [0]}
    held.add_local(4, {"blocks": [0], "step": 4})
    assert held.local_blocks() == {3: [0], 4: [0]}
    # Pins of steps the controller no longer keeps are let go with the next pin request.
    held.pin((2, 0), "part2", keep_from=2)
    held.pin((3, 0), "part3", keep_from=2)
    assert held.pin((4, 0), "part4", keep_from=3) == 2 and set(held.pins) == {(3, 0), (4, 0)}


def test_a_holder_keeps_the_newer_take_of_a_part_and_its_other_copies():
    from elastic_trainer.worker.copies import HeldCopies

    held = HeldCopies()
    # After a rollback to step 3, steps 4 and 5 are taken again (takes 7 and 8).
    held.pin((4, 0, 7), "new4", keep_from=3)
    held.pin((5, 0, 8), "new5", keep_from=3)
    # A pin of take 6, from before the rollback (step 5 then, with step 5 the oldest kept), answers now.
    held.pin((5, 0, 6), "old5", keep_from=5)
    assert held.pinned((5, 0)) == "new5" and held.pinned((4, 0, 7)) == "new4"


def test_holders_are_told_the_oldest_step_the_controller_still_keeps():
    class FakeActor:
        def __init__(self):
            self.calls = []
            self.pin = self  # actor.pin.remote(...)

        def remote(self, key, refs, keep_from):
            self.calls.append((key, keep_from))
            return f"ack{key}"

    store = SnapshotStore(replicas=2, keep=2)
    for step in (1, 2, 3):
        store.snaps[step] = Snapshot(step, 0.0, {0: ShardEntry(f"p{step}", [0], "nodeA")}, committed_at=1.0)
    store.prune()
    assert store.steps() == [2, 3] and store.oldest_kept() == 2
    holder = FakeActor()
    # dp=1: the part's only other copy goes to a worker on another node.
    store.take(4, {0: (10, "nodeA", "p4", [0])}, [(10, FakeActor(), "nodeA"), (11, holder, "nodeB")], {})
    # The key names the take too (the store's first here): a step taken again is another take.
    assert holder.calls == [((4, 0, 1), 2)]


def test_a_worker_reports_the_local_copies_it_made_since_its_set_up():
    import torch

    from elastic_trainer.worker.snapshot_serving import SnapshotServing
    from elastic_trainer.worker.snapshot_taker import SnapshotTaker

    class Stage:
        """What the worker's snapshots ask of its stage, on a real SnapshotTaker."""

        def __init__(self):
            lin = torch.nn.Linear(3, 2)
            self.named = [("blocks.0.weight", lin.weight), ("blocks.0.bias", lin.bias)]
            self.optimizer = torch.optim.AdamW(lin.parameters())
            self.blocks = [0]
            self.snapshots = SnapshotTaker(torch.device("cpu"), 30.0)

        def begin_snapshot(self, step, lend):
            return self.snapshots.begin(step, lend, self.named, self.optimizer, self.blocks, {}, {}, {})

    class Worker(SnapshotServing):
        def __init__(self):
            self._init_snapshots()
            self.copies.keep = 1
            self.trainer = Stage()

    worker = Worker()
    assert worker._copy_made() is None
    worker._begin_snapshot(3, [])             # a DP peer: it writes nothing, it copies
    worker.trainer.snapshots.wait()           # the next update's barrier
    assert worker._copy_made() == 3
    # A writer of all its blocks lends them: no local copy is made.
    worker._begin_snapshot(4, [0])
    worker.trainer.snapshots.wait()
    assert worker._copy_made() is None
    worker._begin_snapshot(5, [])
    worker.trainer.snapshots.wait()
    assert worker._copy_made() == 5
    # A set-up: a copy from before it (maybe of a step rolled back) is not reported again.
    worker._forget_snapshots()
    assert worker._copy_made() is None
    worker.trainer.snapshots.close()


def test_copies_of_an_abandoned_timeline_are_never_offered_for_a_restore():
    # Set-up 1 ran steps 1..12; a failure at 13 restored step 8 (set-up 2). The copies of 9..12
    # made under set-up 1 are of the timeline the run abandoned: once the new timeline passes
    # step 10 again, the old copy of 10 must not stand in for it. (Before, only step numbers
    # counted, and it did.)
    from elastic_trainer.worker.copies import HeldCopies, on_timeline

    held = HeldCopies()
    held.keep = 8
    for step in (8, 9, 10, 11, 12):
        held.add_local(step, {"blocks": [0], "step": step}, generation=1)
    timeline = [(1, 0), (2, 8)]
    assert held.local_blocks(timeline) == {8: [0]}
    assert held.drop_abandoned(timeline) == [9, 10, 11, 12]
    held.add_local(9, {"blocks": [0], "step": 9}, generation=2, timeline=timeline)
    assert held.local_blocks(timeline) == {8: [0], 9: [0]}
    # A copy of step 12 still in flight from set-up 1 lands late: refused, whatever it would evict.
    assert not held.add_local(12, {"blocks": [0], "step": 12}, generation=1, timeline=timeline)
    assert held.local_blocks(timeline) == {8: [0], 9: [0]}
    # Two rollbacks: a copy counts only if no later set-up restored a step before it.
    assert on_timeline(7, 1, [(2, 8), (3, 6)]) is False and on_timeline(6, 1, [(2, 8), (3, 6)])
    assert on_timeline(7, 3, [(2, 8), (3, 6)])


def test_a_late_copy_of_the_failed_step_does_not_evict_the_one_chosen_for_the_restore():
    # snapshots_kept 1: the restore chose the local copy of step 8; the failed step 9's copy
    # was in flight and lands after the controller named the rollback (timeline_to(8)). Before,
    # it replaced step 8's copy and the set-up that loads it failed, counted as a failure.
    from elastic_trainer.worker.copies import HeldCopies

    held = HeldCopies()
    held.keep = 1
    held.add_local(8, {"blocks": [0, 1], "step": 8}, generation=1)
    told = [(1, 0), (2, 8)]          # what the controller's local_steps question carries
    assert held.local_blocks(told) == {8: [0, 1]}
    assert not held.add_local(9, {"blocks": [0, 1], "step": 9}, generation=1, timeline=told)
    assert held.local_copy(8)["step"] == 8
    # The same copy from the new set-up's steps is kept, as the newest.
    assert held.add_local(9, {"blocks": [0, 1], "step": 9}, generation=2, timeline=told)
    assert held.local_blocks(told) == {9: [0, 1]}

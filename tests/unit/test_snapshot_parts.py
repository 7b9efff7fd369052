"""How a stage's snapshot is shared among its DP replicas, and which parts restore a step."""

from elastic_trainer.checkpoint.state import select_blocks, split_blocks
from elastic_trainer.controller.snapshots import ShardEntry, Snapshot, SnapshotStore


def test_blocks_are_dealt_by_size_and_every_block_goes_to_exactly_one_part():
    sizes = {0: 100, 1: 10, 2: 10, 3: 60, 4: 40}
    parts = split_blocks([0, 1, 2, 3, 4], 2, sizes)
    assert sorted(b for p in parts for b in p) == [0, 1, 2, 3, 4]
    loads = [sum(sizes[b] for b in p) for p in parts]
    assert max(loads) - min(loads) <= 20
    assert split_blocks([0, 1, 2, 3, 4], 1, sizes) == [[0, 1, 2, 3, 4]]
    # More replicas than blocks: some put nothing.
    assert sorted(map(len, split_blocks([5, 6], 3, {}))) == [0, 1, 1]


def test_select_blocks_keeps_only_the_names_of_those_blocks():
    shard = {"step": 3, "blocks": [0, 1], "extra": {},
             "params": {"blocks.0.w": 1, "blocks.1.w": 2, "blocks.1.b": 3},
             "optim": {"blocks.0.w": {"exp_avg": 0}, "blocks.1.w": {"exp_avg": 1}}}
    part = select_blocks(shard, [1])
    assert part["blocks"] == [1] and set(part["params"]) == {"blocks.1.w", "blocks.1.b"}
    assert set(part["optim"]) == {"blocks.1.w"} and part["step"] == 3


def test_covering_needs_every_block_and_only_counts_parts_with_a_surviving_copy():
    store = SnapshotStore(replicas=2)
    store.snaps[7] = Snapshot(7, 0.0, {
        0: ShardEntry("r0", [0, 1], "nodeA"),
        1: ShardEntry("r1", [2, 3], "nodeB", pinned={5}),
        2: ShardEntry("r2", [4], "nodeC"),
    })
    assert store.covering(7, 5) == ["r0", "r1", "r2"]
    assert store.covering(7, 6) is None
    assert store.covering(8, 5) is None
    # nodeB is gone but worker 5 holds a pinned copy of rank 1's part; nodeC is gone for good.
    assert store.covering(7, 5, alive_nodes={"nodeA"}, alive_workers={5}) is None
    assert store.covering(7, 4, alive_nodes={"nodeA"}, alive_workers={5}) == ["r0", "r1"]

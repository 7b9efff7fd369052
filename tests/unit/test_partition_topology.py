import pytest

from elastic_trainer.controller.run.placement import assign_ranks
from elastic_trainer.parallel.partition import partition_blocks, stage_indices_for_rank
from elastic_trainer.parallel.topology import Topology


def test_partition_is_contiguous_and_covers_every_block():
    counts = [5, 1, 1, 1, 1, 1, 1, 5]
    for k in range(1, len(counts) + 1):
        bounds = partition_blocks(counts, k)
        assert len(bounds) == k
        assert bounds[0][0] == 0 and bounds[-1][1] == len(counts)
        assert all(a < b for a, b in bounds)
        assert all(bounds[i][1] == bounds[i + 1][0] for i in range(k - 1))


def test_partition_minimises_heaviest_stage():
    counts = [10, 1, 1, 1, 1, 1, 1, 1, 1, 10]
    bounds = partition_blocks(counts, 3)
    heaviest = max(sum(counts[a:b]) for a, b in bounds)
    assert heaviest == 10
    assert bounds == [(0, 1), (1, 9), (9, 10)]


def test_partition_errors():
    with pytest.raises(ValueError, match="cannot cut 2 blocks into 3"):
        partition_blocks([1, 1], 3)


def test_topology_groups():
    t = Topology(dp=2, pp=3)
    assert t.world_size == 6
    assert t.coords(4) == (1, 1)
    assert t.dp_group_ranks(1) == [1, 4]
    assert t.pp_group_ranks(1) == [3, 4, 5]
    with pytest.raises(ValueError):
        Topology(0, 1)


def test_interleaved_stage_indices():
    assert stage_indices_for_rank(1, pp=4, virtual_stages=2) == [1, 5]


def test_spread_keeps_a_stage_replicas_on_different_nodes():
    topo = Topology(dp=2, pp=2)
    slot_nodes = ["a", "a", "b", "b"]
    slots = assign_ranks(topo, slot_nodes, "spread")
    node = {r: slot_nodes[s] for r, s in enumerate(slots)}
    assert node[topo.rank(0, 0)] != node[topo.rank(1, 0)]
    assert node[topo.rank(0, 0)] == node[topo.rank(0, 1)]
    assert sorted(slots) == [0, 1, 2, 3]


def test_pack_keeps_a_stage_replicas_on_one_node():
    topo = Topology(dp=2, pp=2)
    slot_nodes = ["a", "b", "a", "b"]
    slots = assign_ranks(topo, slot_nodes, "pack")
    node = {r: slot_nodes[s] for r, s in enumerate(slots)}
    assert node[topo.rank(0, 0)] == node[topo.rank(1, 0)]
    assert node[topo.rank(0, 1)] == node[topo.rank(1, 1)]
    assert node[topo.rank(0, 0)] != node[topo.rank(0, 1)]

"""Where scaling.worker_memory_gb is unset, a CPU worker is held to its share of the smallest node."""

import pytest

from elastic_trainer.config import TrainerConfig
from elastic_trainer.controller.replanning.memory_bound import HOST_HEADROOM, host_share_bytes, resolve_memory_bound

GIB = 1 << 30


def node(cpus, mem_gib, alive=True):
    return {"Alive": alive, "Resources": {"CPU": cpus, "memory": mem_gib * GIB}}


def test_a_worker_gets_its_share_of_the_smallest_node_it_fits_on():
    nodes = [node(8, 64), node(4, 16), node(0, 4), node(2, 1, alive=False)]
    left = 1 - HOST_HEADROOM   # for Ray's own processes, the driver and the controller
    # 16 GiB over the 4 one-CPU workers that node holds; the CPU-less head and the dead node do not count.
    assert host_share_bytes(nodes, 1.0) == int(4 * GIB * left)
    assert host_share_bytes(nodes, 2.0) == int(8 * GIB * left)
    assert host_share_bytes(nodes, 1.0, workers_per_node=2) == int(8 * GIB * left)
    # The object store counts too: a worker's resident set holds the parts it puts there.
    store = [{"Alive": True, "Resources": {"CPU": 2, "memory": 6 * GIB, "object_store_memory": 2 * GIB}}]
    assert host_share_bytes(store, 1.0) == int(4 * GIB * left)
    assert host_share_bytes(nodes, 16.0) is None   # no node has room for such a worker
    assert host_share_bytes([], 1.0) is None


def test_a_bound_given_is_kept_and_an_unset_one_comes_from_the_cluster(monkeypatch):
    import elastic_trainer.controller.replanning.memory_bound as mb

    given = TrainerConfig.model_validate({"data": {"path": "x"}, "scaling": {"worker_memory_gb": 3}})
    assert resolve_memory_bound(given, "r") is None and given.scaling.worker_memory_gb == 3
    unset = TrainerConfig.model_validate({"data": {"path": "x"}})
    monkeypatch.setattr(mb.ray, "nodes", lambda: [node(4, 16)])
    said = resolve_memory_bound(unset, "r")
    assert unset.scaling.worker_memory_gb == pytest.approx(3.6)
    assert "3.60 GiB: a worker's share of the smallest node's memory" in said

import time

import pytest
import ray
from ray.cluster_utils import Cluster

from elastic_trainer.worker.allocator import nodes_start_on

NUM_NODES = 4
# Ray's GCS declares a killed node dead once it misses this many health checks, this far apart
# (Ray's defaults, 5 x 3 s, take about 15 s); until then a new run could place a worker there.
# A run sees a loss when the actor's connection drops, without it, but the next test's handover
# waits for it: with these a killed node is declared dead in about 5 s. (A run that waited on
# it, such as a pull from the dead node, would wait less here; benchmarks/ keep the defaults.)
_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 4}
# A handover waits for that (less than a new cluster's 9 s), up to this long.
_SETTLE_S = 30.0


def start_cluster(num_nodes: int) -> tuple[Cluster, list]:
    """A head with no CPUs (so work lands on removable nodes) plus one-CPU nodes, started on
    jemalloc as a local cluster of the trainer's is: Ray's idle processes can serve as workers
    (``worker.allocator``)."""
    with nodes_start_on("jemalloc"):
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                          "_system_config": _HEALTH_CHECKS})
    nodes = [add_node(c) for _ in range(num_nodes)]
    c.wait_for_nodes()
    ray.init(address=c.address)
    return c, nodes


def add_node(c: Cluster, **args):
    """A one-CPU node (``args`` for Ray's ``add_node``), its processes on jemalloc as the head's."""
    with nodes_start_on("jemalloc"):
        return c.add_node(**{"num_cpus": 1, **args})


def stop_cluster(c: Cluster) -> None:
    ray.shutdown()
    c.shutdown()


class SharedCluster:
    """One simulated cluster for the integration tests, handed to each test with the nodes it
    asks for: starting one costs about 9 s, topping it up after a test killed a node about 1 s.

    A handover takes the cluster as the last test left it, removes or adds one-CPU nodes to
    the count asked for, and then waits until Ray sees exactly those nodes alive (a killed
    node is declared dead some seconds after), every CPU free and no named actor left
    (nothing of the last test still runs, its controller included). Where that does not
    settle, the cluster is started anew."""

    def __init__(self):
        self.c: Cluster | None = None
        self.nodes: list = []

    def get(self, num_nodes: int) -> tuple[Cluster, list]:
        if self.c is not None and not self._top_up(num_nodes):
            self.close()
        if self.c is None:
            self.c, self.nodes = start_cluster(num_nodes)
        return self.c, list(self.nodes)

    def _top_up(self, num_nodes: int) -> bool:
        c = self.c
        live = [n for n in self.nodes if n in c.worker_nodes]
        live += [n for n in c.worker_nodes if n not in live]   # nodes a test added
        for node in live[num_nodes:]:
            c.remove_node(node, allow_graceful=True)
        live = live[:num_nodes]
        live += [add_node(c) for _ in range(num_nodes - len(live))]
        self.nodes = live
        want = {c.head_node.node_id} | {n.node_id for n in live}
        deadline = time.monotonic() + _SETTLE_S
        while time.monotonic() < deadline:
            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            if (alive == want and ray.available_resources().get("CPU", 0) == num_nodes
                    and not ray.util.list_named_actors(all_namespaces=True)):
                return True
            time.sleep(0.1)
        return False

    def close(self) -> None:
        if self.c is not None:
            stop_cluster(self.c)
        self.c, self.nodes = None, []


@pytest.fixture(scope="package")
def shared_cluster():
    pool = SharedCluster()
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    """Four one-CPU nodes shared by a module's tests (none of which removes nodes)."""
    return shared_cluster.get(NUM_NODES)


@pytest.fixture
def fresh_cluster(shared_cluster):
    """For a test that kills or adds nodes: call with the number of one-CPU nodes (default four)
    it starts with. Earlier tests may have used them; nothing of theirs still runs."""
    return lambda num_nodes=NUM_NODES: shared_cluster.get(num_nodes)


@pytest.fixture
def own_ray(shared_cluster):
    """For a test that starts a Ray of its own: the shared cluster is stopped first."""
    shared_cluster.close()

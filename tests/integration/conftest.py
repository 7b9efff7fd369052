import pytest
import ray
from ray.cluster_utils import Cluster

NUM_NODES = 4


def start_cluster(num_nodes: int) -> tuple[Cluster, list]:
    """A head with no CPUs (so work lands on removable nodes) plus one-CPU nodes."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [c.add_node(num_cpus=1) for _ in range(num_nodes)]
    c.wait_for_nodes()
    ray.init(address=c.address)
    return c, nodes


def stop_cluster(c: Cluster) -> None:
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def cluster():
    """Four one-CPU nodes shared by a module's tests (none of which removes nodes)."""
    c, nodes = start_cluster(NUM_NODES)
    yield c, nodes
    stop_cluster(c)


@pytest.fixture
def fresh_cluster():
    """A cluster of its own for a test that kills nodes: call with the number of nodes."""
    made = []

    def make(num_nodes: int = NUM_NODES):
        c, nodes = start_cluster(num_nodes)
        made.append(c)
        return c, nodes

    yield make
    for c in made:
        stop_cluster(c)

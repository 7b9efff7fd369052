import pytest
import ray
from ray.cluster_utils import Cluster

NUM_NODES = 4


@pytest.fixture(scope="session")
def cluster():
    """A head with no CPUs (so work lands on removable nodes) plus four one-CPU nodes."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [c.add_node(num_cpus=1) for _ in range(NUM_NODES)]
    c.wait_for_nodes()
    ray.init(address=c.address)
    yield c, nodes
    ray.shutdown()
    c.shutdown()

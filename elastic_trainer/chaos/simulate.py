"""A multi-node Ray cluster on one machine, for seeing recovery in the first minutes.

``ray.cluster_utils.Cluster`` runs several Ray nodes (raylets) on this machine;
removing one without grace is a node loss as the rest of the cluster sees it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import ray

from ..config import TrainerConfig
from ..naming import NAMESPACE


def object_store_bytes() -> int:
    """Bytes held in the object stores of every node of the connected cluster now."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.object_store_bytes_used)


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def drain_node(node_id: str, deadline_s: float | None, reason: str = "preempted", address: str | None = None) -> None:
    """A preemption notice for ``node_id``, through Ray's own GCS ``DrainNode`` with reason
    PREEMPTION, as ``ray drain-node`` and Ray's cloud integrations issue it: ``deadline_s``
    seconds left (None: no deadline). ``address``: the GCS (default: the connected cluster's).
    Raises when the GCS refuses the drain."""
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=address or ray.get_runtime_context().gcs_address)
    deadline_ms = int((time.time() + deadline_s) * 1000) if deadline_s else 0
    accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   reason, deadline_ms)
    if not accepted:
        raise RuntimeError(f"the GCS refused to drain node {node_id[:12]}: {why}")


def freeze_node(node) -> list[int]:
    """Stop a simulated node whole (SIGSTOP to its raylet and every process below it): nothing
    exits and no connection closes, as when a machine freezes. Returns the pids, for
    :func:`kill_pids` once done (Linux)."""
    pids = process_tree(node.all_processes["raylet"][0].process.pid)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def kill_pids(pids) -> None:
    """SIGKILL each of ``pids`` still alive (a stopped process dies too)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class SimulatedCluster:
    def __init__(self, cluster, nodes, run_name: str):
        self.cluster = cluster
        self.nodes = nodes
        self.run_name = run_name

    def kill_node_of_rank(self, rank: int | None = None) -> str | None:
        """Remove (SIGKILL) the node hosting ``rank`` (default: the highest rank)."""
        st = ray.get(ray.get_actor(f"{self.run_name}-controller", namespace=NAMESPACE).status.remote())
        ranked = [w for w in st["workers"] if w["rank"] is not None]
        if not ranked:
            return None
        target = max(ranked, key=lambda w: w["rank"]) if rank is None else next(w for w in ranked if w["rank"] == rank)
        node = next((n for n in self.nodes if n.node_id == target["node_id"]), None)
        if node is None:
            return None
        print(f"!! killing node {node.node_id[:8]} (rank {target['rank']}, pid {target['pid']}) at step {st['step']}",
              flush=True)
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)
        return node.node_id

    def killer(self, at_step: int | None):
        """An on_step callback that kills one node once ``at_step`` is done."""
        state = {"done": at_step is None}

        def on_step(rec: dict) -> None:
            if not state["done"] and rec["step"] >= at_step:
                state["done"] = True
                self.kill_node_of_rank()

        return on_step


@contextlib.contextmanager
def simulated_cluster(num_nodes: int, cfg: TrainerConfig):
    """Start a head (no CPUs, so work lands on removable nodes) plus ``num_nodes`` nodes sized for one worker."""
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    cpus = max(1, int(cfg.scaling.resources_per_worker.get("CPU", 1) + 0.999)) * (cfg.scaling.workers_per_node or 1)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=cpus) for _ in range(num_nodes)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        yield SimulatedCluster(cluster, nodes, cfg.run.name)
    finally:
        ray.shutdown()
        cluster.shutdown()

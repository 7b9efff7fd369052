"""The questions a worker answers whatever its training thread is doing: who and where it is,
whether it and its node-mates live, how fast its device is now, how far its set-up has got.

A mixin of ``TrainWorker`` (on its ``control`` concurrency group): it needs ``worker_id``,
``gpu`` and ``faults``.
"""

from __future__ import annotations

import os
import socket

import ray

from .allocator import in_use as allocator_in_use
from .device import bind
from .heartbeat_relay import relay_pings
from .liveness import process_mark, running
from .memory_kills import memory_limit, oom_kills
from .probe import probe_compute
from .process_group import free_port
from .setup_progress import PROGRESS


class WorkerQuestions:
    @ray.method(concurrency_group="control")
    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "worker_id": self.worker_id,
            "pid": os.getpid(),
            "mark": process_mark(),
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "group_iface": os.environ.get("GLOO_SOCKET_IFNAME"),
            "gpu_ids": ray.get_gpu_ids(),
            # The kernel's OOM kills in this worker's memory cgroup so far: a count that has risen
            # when it is dead says memory killed it (controller.memory_kills).
            "oom_kills": oom_kills(),
            "memory_limit": memory_limit(),
            "allocator": allocator_in_use(),
        }

    @ray.method(concurrency_group="control")
    def setup_progress(self) -> tuple[int, int]:
        """(units, bytes) of set-up work done so far (``setup_progress``): moving means slow, not stuck."""
        return PROGRESS.read()

    @ray.method(concurrency_group="control")
    def reserve_port(self) -> int:
        return free_port()

    @ray.method(concurrency_group="control")
    def ping(self) -> bool:
        return True

    @ray.method(concurrency_group="control")
    def ping_node(self, mates: dict[int, tuple[int, str]]) -> dict[int, bool | None]:
        """A heartbeat for this node: this worker answers, and says of each node-mate
        (worker id -> (pid, mark)) whether its process runs (``liveness.running``)."""
        return {w: running(pid, mark) for w, (pid, mark) in mates.items()}

    @ray.method(concurrency_group="control")
    def relay_pings(self, asks: dict, wait_s: float) -> dict:
        """The controller's heartbeat question, asked of other nodes for it (``heartbeat_relay``)."""
        return relay_pings(asks, wait_s, self.worker_id, self.ping_node)

    @ray.method(concurrency_group="control")
    def probe(self, products: int | None = None) -> tuple[float, int]:
        """(seconds a fixed workload takes on this worker's device now, its size): how a benched
        straggler shows it has recovered (``worker.probe``; ``products`` None sizes it)."""
        bind(self.gpu)
        return probe_compute(self.gpu, self.faults.slow, products)

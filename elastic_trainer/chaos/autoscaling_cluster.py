"""A Ray cluster on this machine with Ray's own autoscaler: its head runs the autoscaler with
the fake multi-node provider, which launches real raylets here when resources are asked for
(``request_resources``, or work that does not fit) and ends them when they idle.

``ray.cluster_utils.AutoscalingCluster`` does the same but ends it with ``ray stop --force``,
which ends every Ray process on the machine, other clusters included. This one starts its head
as one process tree (``ray start --head --block``) on loopback and a port of its own, and ends
exactly that tree, by process id, nodes the autoscaler launched included.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from ray._common.utils import get_ray_address_file
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

from ..worker.liveness import kill_marked, process_mark
from .simulate import process_tree

_FAKE_PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
# Where `ray start` records the machine's current cluster, which `ray.init()` without an address joins.
CURRENT_CLUSTER = get_ray_address_file(None)
# The node type the autoscaler launches (a one-CPU worker node by default).
WORKER_TYPE = "ray.worker.cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def autoscaling_config(address: str, head_cpus: float, worker_resources: dict, max_workers: int,
                       idle_timeout_minutes: float) -> dict:
    """The cluster config the head's autoscaler reads: a head of ``head_cpus`` that launches up to
    ``max_workers`` nodes of ``worker_resources``, with the fake multi-node provider."""
    return {
        "cluster_name": "elastic-trainer-local",
        "max_workers": max_workers,
        # Named as an external module: Ray's wheel lacks the defaults file its "fake_multinode" type reads.
        "provider": {"type": "external", "module": _FAKE_PROVIDER, "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": address,
                     # One node per launch otherwise, whatever the count asked (Ray 2.60).
                     "launch_multiple": True, "head_node_id": FAKE_HEAD_NODE_ID},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0},
            WORKER_TYPE: {"resources": dict(worker_resources), "node_config": {}, "min_workers": 0,
                          "max_workers": max_workers},
        },
        "head_node_type": "ray.head.default",
        "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": idle_timeout_minutes, "docker": {},
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [],
    }


class LocalAutoscalingCluster:
    """``with LocalAutoscalingCluster(...) as c:`` then ``ray.init(c.address)``; nodes come as the
    autoscaler launches them. Without token authentication: while it runs, this process's
    ``RAY_AUTH_MODE`` is ``disabled`` (a driver started elsewhere to join it needs the same). ``worker_resources`` of each launched node; ``object_store_memory``
    per node in bytes."""

    def __init__(self, head_cpus: float = 1.0, worker_resources: dict | None = None, max_workers: int = 4,
                 idle_timeout_minutes: float = 5.0, object_store_memory: int = 150 << 20, log_dir: str | None = None,
                 system_config: dict | None = None):
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.worker_resources = dict(worker_resources or {"CPU": 1})
        self.worker_resources.setdefault("object_store_memory", object_store_memory)
        self.config = autoscaling_config(self.address, head_cpus, self.worker_resources, max_workers,
                                         idle_timeout_minutes)
        self.head_cpus, self.object_store_memory, self.system_config = head_cpus, object_store_memory, system_config
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="et-autoscaling-")
        self._proc: subprocess.Popen | None = None
        self._current: str | None = None
        self._auth_mode: str | None = None
        self._seen: dict[int, str] = {}   # pid -> start mark, of every process of the tree seen

    def start(self, timeout_s: float = 60.0) -> "LocalAutoscalingCluster":
        # `ray start` names its cluster the machine's current one, which a later `ray.init()`
        # without an address joins: put back what was there at the end.
        self._current = _read(CURRENT_CLUSTER)
        # The head runs without a token, and so must the drivers that join it: a driver in token
        # mode asks the GCS's calls for a token, finds none, and the GCS then takes the driver for
        # failed and destroys its actors before they run. Ray itself turns token mode on in a
        # process's environment once a local cluster started there finds ~/.ray/auth_token.
        self._auth_mode = os.environ.get("RAY_AUTH_MODE")
        os.environ["RAY_AUTH_MODE"] = "disabled"
        path = os.path.join(self.log_dir, "autoscaling.json")
        with open(path, "w") as f:
            json.dump(self.config, f)
        # Loopback only; no token (the drivers here run without one); the autoscaler looks every second.
        env = dict(os.environ, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1",
                   RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled",
                   # Autoscaler v2: it reconciles its nodes with the GCS, so a node that died is
                   # replaced (v1 with this provider counts a killed node as pending for good).
                   RAY_enable_autoscaler_v2="1", RAY_CLOUD_INSTANCE_ID=FAKE_HEAD_NODE_ID,
                   RAY_OVERRIDE_NODE_ID_FOR_TESTING=FAKE_HEAD_NODE_ID)
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        cmd = [ray_cli, "start", "--head", "--block", f"--autoscaling-config={path}", f"--port={self.port}",
               "--node-ip-address=127.0.0.1", f"--num-cpus={self.head_cpus:g}",
               f"--object-store-memory={self.object_store_memory}", "--include-dashboard=false",
               "--disable-usage-stats"]
        if self.system_config:
            cmd.append("--system-config=" + json.dumps(self.system_config, separators=(",", ":")))
        with open(os.path.join(self.log_dir, "head.log"), "ab") as log:
            self._proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the autoscaling head exited ({self._proc.returncode}); see "
                                   f"{os.path.join(self.log_dir, 'head.log')}")
            if self._head_up():
                return self
            time.sleep(0.2)
        self.shutdown()
        raise TimeoutError(f"the autoscaling head at {self.address} did not come up in {timeout_s:g} s")

    def _head_up(self) -> bool:
        self._note_tree()
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                pass
        except OSError:
            return False
        return any("monitor.py" in _cmdline(pid) for pid in self._seen)

    def _note_tree(self) -> None:
        if self._proc is None:
            return
        for pid in process_tree(self._proc.pid):
            mark = process_mark(pid)
            if mark is not None:
                self._seen.setdefault(pid, mark)

    def shutdown(self) -> list[int]:
        """End the head and everything it started (the autoscaler's nodes and their workers
        too), by process id; the ids ended. The autoscaler goes first, so it launches nothing
        meanwhile; then the tree, again until nothing new is in it."""
        ended: list[int] = []
        self._note_tree()
        first = [pid for pid in self._seen if "monitor.py" in _cmdline(pid)]
        for _ in range(5):
            self._note_tree()
            todo = first + [pid for pid in self._seen if pid not in ended and pid not in first]
            first = []
            killed = [pid for pid in todo if kill_marked(pid, self._seen[pid]) in ("killed", "unmarked")]
            ended += killed
            if not killed:
                break
        if self._proc is not None:
            self._proc.wait(30)
        if self._auth_mode is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = self._auth_mode
        if _read(CURRENT_CLUSTER) == self.address:
            if self._current is None:
                os.remove(CURRENT_CLUSTER)
            else:
                with open(CURRENT_CLUSTER, "w") as f:
                    f.write(self._current)
        return ended

    def kill_node(self, node_id: str) -> list[int]:
        """SIGKILL a node the autoscaler launched, whole (its raylet and every process below it),
        as a machine lost; the ids killed. Its provider still counts it until Ray declares it dead."""
        raylets = [pid for pid in process_tree(self._proc.pid)
                   if _cmdline(pid).split(" ")[0].endswith("/raylet") and f"--node_id={node_id}" in _cmdline(pid)]
        if not raylets:
            raise ValueError(f"no raylet of node {node_id} in this cluster")
        pids = [pid for r in raylets for pid in process_tree(r)]
        for pid in pids:
            kill_marked(pid, process_mark(pid))
        return pids

    def __enter__(self) -> "LocalAutoscalingCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

"""The lab: N hosts on one machine, each a network namespace with its own address and a cgroup
with a CPU quota and a memory limit, each running a Ray node; the first host is the head.

    with Lab(hosts=5, cpus_per_host=0.35) as lab:
        lab.start_ray()
        driver = lab.spawn(lab.head, [sys.executable, "my_driver.py"])
        lab.cut(lab.hosts[2]); ...; lab.heal(lab.hosts[2])

Every host sees its own ``/tmp/ray``: Ray nodes on one machine share Ray's
temporary directory otherwise, and a second raylet started in another namespace
fails at start ("bind: Address already in use" on the first one's sockets).
Each process enters its host's network namespace (``nsenter``) in a mount
namespace of its own (``unshare``), in which the host's directory is bound over
``/tmp/ray``.

Teardown always runs (``close``, the context manager, and at exit): it kills
every process of every host's cgroup, then removes the cgroups, namespaces,
veths, qdiscs and the bridge. ``sweep`` removes what an interrupted lab left.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import cgroups, net

PREFIX = "etlab"
GCS_PORT = 6379
# Ray declares a killed node dead after this many missed health checks this far apart
# (Ray's defaults, 5 x 3 s, take about 15 s); tests/integration/conftest.py uses the same.
HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "4"}


@dataclass
class Host:
    """One lab host: its namespace, address, link and cgroup."""
    index: int
    ns: str
    veth: str              # the bridge's end of its link
    address: str
    group: cgroups.HostGroup
    dir: Path              # its own /tmp/ray and logs
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"h{self.index}"


class Lab:
    """A lab of ``hosts`` hosts (the first is Ray's head). ``cpus_per_host``: each host's CPU
    quota in cores; ``head_cpus``: the head's (default the same), which runs the GCS, the
    driver and the controller; ``memory_gb``: each host's memory limit; ``link_mbit``: each
    link's cap."""

    def __init__(self, hosts: int, cpus_per_host: float = 0.4, memory_gb: float | None = 3.0,
                 link_mbit: float | None = None, root: str | os.PathLike | None = None,
                 head_cpus: float | None = None):
        if hosts < 1:
            raise ValueError(f"a lab needs at least 1 host, not {hosts}")
        self.id = f"{PREFIX}{secrets.token_hex(2)}"
        self.bridge = f"{self.id}br"
        # A root of the caller's is left in place (its logs); the lab's own is removed.
        self._own_root = root is None
        self.root = Path(root) / self.id if root else Path(f"/tmp/{self.id}")
        self.hosts: list[Host] = []
        # Ray turns token authentication on for a cluster off loopback; every process of the
        # lab's, the driver included, carries the lab's token.
        # The suite keeps Ray on loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0); the lab's nodes
        # are on their own addresses, on the lab's bridge and nowhere else.
        self.ray_env = {**HEALTH_CHECKS, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
        self.memory_gb = memory_gb
        self._closed = False
        atexit.register(self.close)
        self._on_term = _stop_on_sigterm()
        try:
            self._build(hosts, cpus_per_host, memory_gb, link_mbit, head_cpus)
        except BaseException:
            self.close()
            raise

    def _build(self, n: int, cpus: float, memory_gb: float | None, link_mbit: float | None,
               head_cpus: float | None) -> None:
        subnet = net.free_subnet()
        self.subnet = subnet
        net.make_bridge(self.bridge)
        addrs = list(subnet.hosts())
        for i in range(n):
            ns, veth = f"{self.id}-h{i}", f"{self.id}v{i}"
            d = self.root / f"h{i}"
            (d / "ray").mkdir(parents=True, exist_ok=True)
            quota = head_cpus if i == 0 and head_cpus is not None else cpus
            group = cgroups.HostGroup(f"{self.id}/h{i}", quota, int(memory_gb * 2**30) if memory_gb else None)
            host = Host(i, ns, veth, str(addrs[i + 1]), group, d)
            self.hosts.append(host)
            net.make_host_netns(ns, self.bridge, veth, host.address, subnet.prefixlen)
            if link_mbit:
                net.cap_rate(ns, veth, link_mbit)

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def gcs_address(self) -> str:
        return f"{self.head.address}:{GCS_PORT}"

    # --- processes ---------------------------------------------------------------------------

    def spawn(self, host: Host, argv: list[str], env: dict | None = None, log: str | None = None) -> subprocess.Popen:
        """Start ``argv`` on ``host``: in its namespace and cgroup, with its own ``/tmp/ray``.
        Its output goes to ``<host dir>/<log>`` (default: the program's name)."""
        Path("/tmp/ray").mkdir(exist_ok=True)
        script = f"mount --bind {host.dir / 'ray'} /tmp/ray && exec \"$@\""
        procs = host.group.procs_files()

        def join_cgroup() -> None:
            # Before exec, in the child: every process it starts is the host's from the first.
            for f in procs:
                f.write_text(str(os.getpid()))
        out = open(host.dir / f"{log or Path(argv[0]).name}.log", "ab")
        full_env = {**os.environ, **self.ray_env}
        full_env.pop("RAY_ADDRESS", None)   # the caller's cluster is not the lab's
        full_env.update(env or {})
        # nsenter rather than ``ip netns exec``: that one remounts /sys for the namespace, which
        # hides the cgroup files a process reads its own memory limit and OOM kills from.
        p = subprocess.Popen(["nsenter", f"--net=/run/netns/{host.ns}", "unshare", "--mount", "--propagation",
                              "private", "sh", "-c", script, "sh", *argv],
                             stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
                             preexec_fn=join_cgroup)
        out.close()
        host.procs.append(p)
        return p

    def start_ray(self, cpus_per_node: float = 1, head_cpus: float = 0, object_store_mb: int = 150,
                  timeout_s: float = 60) -> None:
        """A Ray node on every host (the head on the first, with ``head_cpus``: none, so work
        lands on hosts that can be lost), then wait until all are alive."""
        with self._booting(self.hosts):
            self.spawn(self.head, self._node_argv(self.head, head_cpus, object_store_mb), log="ray")
            for h in self.hosts[1:]:
                self.spawn(h, self._node_argv(h, cpus_per_node, object_store_mb), log="ray")
            self.await_nodes(len(self.hosts), timeout_s)

    def restart_ray(self, hosts: list[Host], cpus: float = 1, object_store_mb: int = 150,
                    timeout_s: float = 60, expect: int | None = None) -> None:
        """Start ``hosts``' Ray nodes again (after a kill, or once Ray declared them dead), all of
        them before waiting until the cluster has ``expect`` nodes alive (default: every host's)."""
        if self.head in hosts:
            raise ValueError("the head's Ray node holds the cluster: a lab whose head was lost is built anew")
        with self._booting(hosts):
            for h in hosts:
                self.spawn(h, self._node_argv(h, cpus, object_store_mb), log="ray")
            self.await_nodes(len(self.hosts) if expect is None else expect, timeout_s)

    @contextlib.contextmanager
    def _booting(self, hosts: list[Host]):
        """``hosts`` without their CPU quota while their Ray nodes start. A node's start is
        several Python processes' imports (about 4 s of CPU), which a real machine does on its
        own cores; at a lab host's share of this machine's it took 25 s, in every test's set-up.
        What the lab measures runs on started nodes, under the quota."""
        quotas = {h.index: h.group.cpus for h in hosts}
        for h in hosts:
            h.group.set_cpus(os.cpu_count() or 1)
        try:
            yield
        finally:
            for h in hosts:
                h.group.set_cpus(quotas[h.index])

    def _node_argv(self, host: Host, cpus: float, object_store_mb: int) -> list[str]:
        argv = [str(Path(sys.executable).with_name("ray")), "start", "--block", "--disable-usage-stats",
                f"--node-ip-address={host.address}", f"--num-cpus={cpus}",
                f"--object-store-memory={object_store_mb * 2**20}"]
        if host is self.head:
            return argv + ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
        return argv + [f"--address={self.gcs_address}"]

    def revive(self) -> None:
        """Every host back with a live Ray node: thawed, its link up, its memory limit the lab's,
        and where its node is not alive (killed, or declared dead while frozen or cut off), what
        is left of its processes killed and its node started anew."""
        for h in self.hosts[1:]:
            self.thaw(h)
            self.heal(h)
            self.limit_memory(h, self.memory_gb)
        alive = node_alive_addresses(self)
        lost = [h for h in self.hosts[1:] if h.address not in alive]
        for h in lost:
            self.kill(h)
        if lost:
            # Together: each restart waits for every host's node, so one at a time would wait
            # for the next one's, never started, after a loss of two.
            self.restart_ray(lost)

    def host_at(self, address: str) -> Host:
        return next(h for h in self.hosts if h.address == address)

    def await_nodes(self, count: int, timeout_s: float = 60) -> list[dict]:
        """Wait until Ray sees ``count`` nodes alive, asked from the head; their ids and addresses."""
        nodes = self.alive_nodes(count, timeout_s)
        if len(nodes) != count:
            raise RuntimeError(f"the lab's Ray cluster has {len(nodes)} of {count} nodes alive after {timeout_s:g} s; "
                               f"see {self.root}/h*/ray.log")
        return nodes

    def alive_nodes(self, count: int | None = None, timeout_s: float = 0) -> list[dict]:
        """The nodes Ray sees alive, asked from the head (id, ip): at once, or once there are
        ``count`` of them, waiting up to ``timeout_s``."""
        code = ("import json, time, ray\n"
                f"ray.init(address='{self.gcs_address}', logging_level='ERROR')\n"
                f"deadline = time.monotonic() + {timeout_s}\n"
                "while True:\n"
                "    alive = [n for n in ray.nodes() if n['Alive']]\n"
                f"    if len(alive) == {count if count is not None else -1} or time.monotonic() >= deadline: break\n"
                "    time.sleep(0.2)\n"
                "print('NODES ' + json.dumps([{'id': n['NodeID'], 'ip': n['NodeManagerAddress']} for n in alive]))\n")
        log = self.head.dir / "nodes.log"
        log.unlink(missing_ok=True)
        p = self.spawn(self.head, [sys.executable, "-c", code], log="nodes")
        try:
            p.wait(timeout=timeout_s + 60)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
        found = [line for line in log.read_text().splitlines() if line.startswith("NODES ")]
        if not found:
            raise RuntimeError(f"could not ask the lab's head for its nodes: {log.read_text()[-2000:]}")
        return json.loads(found[-1][len("NODES "):])

    def run_driver(self, config: dict, out: str | os.PathLike) -> subprocess.Popen:
        """Start a training run of ``config`` (a ``TrainerConfig`` as a dict) from the head host,
        as a user's driver there would (``lab.driver``): its steps as they come in
        ``out/progress.jsonl``, its result in ``out/result.json``."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config))
        repo = Path(__file__).resolve().parents[1]
        env = {"RAY_ADDRESS": self.gcs_address,
               "PYTHONPATH": os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH")) if p)}
        return self.spawn(self.head, [sys.executable, "-m", "lab.driver", str(out / "config.json"), str(out)],
                          env=env, log="driver")

    # --- faults ------------------------------------------------------------------------------

    def kill(self, host: Host) -> int:
        """Every process of the host, SIGKILL (a machine lost whole); how many there were."""
        return host.group.kill()

    def freeze(self, host: Host) -> None:
        host.group.freeze()

    def thaw(self, host: Host) -> None:
        host.group.thaw()

    def cut(self, host: Host) -> None:
        """Take the host's link down: nothing closes, its peers hear nothing more."""
        net.set_link(host.veth, up=False)

    def heal(self, host: Host) -> None:
        net.set_link(host.veth, up=True)

    def cap(self, host: Host, mbit: float | None) -> None:
        net.cap_rate(host.ns, host.veth, mbit)

    def limit_memory(self, host: Host, gb: float | None) -> None:
        host.group.set_memory(int(gb * 2**30) if gb else None)

    def memory_used_gb(self, host: Host) -> float:
        """What the host's processes use now, in GB (its cgroup's count)."""
        return host.group.memory_usage() / 2**30

    # --- teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every host's processes and remove everything the lab made. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for h in self.hosts:
            for step in (h.group.remove, lambda: net.delete_netns(h.ns), lambda: net.delete_link(h.veth)):
                try:
                    step()
                except Exception as e:  # noqa: BLE001 - go on removing the rest, then report
                    errors.append(f"{h.name}: {e}")
            for p in h.procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    errors.append(f"{h.name}: pid {p.pid} outlived its cgroup's kill")
        net.delete_link(self.bridge)
        cgroups.remove_tree_everywhere(self.id)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
        atexit.unregister(self.close)
        if self._on_term is not None:
            signal.signal(signal.SIGTERM, self._on_term)
        if errors:
            raise RuntimeError(f"lab {self.id} teardown: " + "; ".join(errors))

    def __enter__(self) -> "Lab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stop_on_sigterm():
    """Make SIGTERM end the process by SystemExit, which runs the teardown (its default handler
    would end it at once, leaving the hosts behind). The handler it replaced, to put back; None
    where it was not the default or this is not the main thread."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    return signal.SIG_DFL


def node_alive_addresses(lab: Lab) -> set[str]:
    """The addresses of the hosts whose Ray node is alive now."""
    return {n["ip"] for n in lab.alive_nodes()}


def leftovers(prefix: str = PREFIX) -> dict[str, list]:
    """What labs named ``prefix...`` left on this machine: namespaces, links, cgroups, and
    processes started in a lab namespace. Empty lists where they left nothing."""
    return {"netns": net.lab_netns(prefix), "links": net.lab_links(prefix),
            "cgroups": [str(p) for p in cgroups.lab_roots(prefix)], "processes": _lab_processes(prefix)}


def sweep(prefix: str = PREFIX) -> dict[str, list]:
    """Remove whatever labs named ``prefix...`` left (an interrupted run's); what was found."""
    found = leftovers(prefix)
    for root in cgroups.lab_roots(prefix):
        cgroups.kill_tree(root)
    for ns in found["netns"]:
        net.delete_netns(ns)
    for link in net.lab_links(prefix):
        net.delete_link(link)
    for root in cgroups.lab_roots(prefix):
        cgroups.remove_tree(root)
    for d in Path("/tmp").glob(f"{prefix}*"):
        shutil.rmtree(d, ignore_errors=True)
    return found


def _lab_processes(prefix: str) -> list[int]:
    """Processes in a network namespace named ``prefix...`` (by ``ip netns pids``)."""
    out = []
    for ns in net.lab_netns(prefix):
        out += [int(p) for p in net.sh("ip", "netns", "pids", ns, check=False).stdout.split()]
    return out


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.05):
    """Poll ``predicate`` until it returns something true; that value. Raises naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = predicate()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(poll_s)

"""The fault campaign on lab hosts: the lab's owner's side.

The campaign itself (``elastic_trainer.chaos.campaign``: schedules, runs, the checker, the
shrinking) runs where a user's driver would, on the head host (``lab.campaign_driver``), against
the lab's Ray cluster and an S3 server on the head's address. What a host suffers is done here,
by the ``Lab`` that made the hosts, when the driver asks (``lab.channel``) while its run holds at
the fault's point:

- ``kill_node``: every process of the host killed (a machine lost whole);
- ``freeze``: every process of the host stopped (cgroup freezer), thawed ``seconds`` later;
- ``cut``: the host's link down, up again ``seconds`` later: nothing closes, nothing is heard;
- ``memory_kill``: the host's memory limit brought near what it uses and a process of the host
  takes memory until the kernel's OOM killer ends one: the run's worker, which Ray marks as the
  first to go (``oom_score_adj`` 1000), as it would on a host another tenant filled;
- ``join``: the host kept without a Ray node starts one;
- ``drain`` (the driver drained the host's node through the GCS): every process of the host
  killed at the drain's deadline, as the cloud takes a preempted machine.

Hosts: the head (the driver, the controller, the S3 server), one per rank, the spares, and one
kept for joins. Between schedules every host is made whole again (``top_up``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from . import cgroups
from .channel import Channel
from .hosts import Host, Lab, leftovers, node_alive_addresses, sweep

# The memory-kill's pressure: the host's limit is set this far above what it uses, then a process
# takes memory in chunks until the kernel's count of OOM kills in the host's cgroup rises.
_HEADROOM = 256 << 20
_HOG = r"""
import sys, time
counter, before, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def kills():
    for line in open(counter):
        k, _, v = line.partition(" ")
        if k == "oom_kill":
            return int(v)
    return 0
held = []
while kills() <= before and len(held) * (32 << 20) < cap:
    held.append(b"\x01" * (32 << 20))
time.sleep(3600)
"""
_KILL_WAIT_S = 30.0
_EXIT_WAIT_S = 10.0


class HostFaults:
    """Answers the driver's requests: ``top_up``, ``strike`` (a host's fault), ``join``,
    ``settle``, ``pending``."""

    def __init__(self, lab: Lab, join_host: Host):
        self.lab, self.join_host = lab, join_host
        self._timers: list[threading.Timer] = []
        self._undo: list = []   # what a settle undoes now: (fn, host)

    @property
    def kept(self) -> list[Host]:
        """The hosts with a Ray node at a schedule's start: all but the head and the join host."""
        return [h for h in self.lab.hosts[1:] if h is not self.join_host]

    def handle(self, req: dict):
        op = req["op"]
        if op == "top_up":
            return self.top_up()
        if op == "join":
            self.lab.restart_ray([self.join_host], expect=len(self.kept) + 2)
            return {"done": "joined", "host": self.join_host.address}
        if op == "strike":
            return self.strike(req["kind"], self.lab.host_at(req["address"]), req.get("seconds", 0.0))
        if op == "settle":
            self.settle()
            return {}
        if op == "pending":
            return {"pending": any(t.is_alive() for t in self._timers)}
        raise ValueError(f"unknown request {op!r}; requests: top_up, join, strike, settle, pending")

    def top_up(self) -> dict:
        """Every kept host thawed, linked, at the lab's memory limit, with a live Ray node; the join
        host with none. Returns the kept hosts' addresses."""
        self.settle()
        for h in self.kept:
            self.lab.thaw(h)
            self.lab.heal(h)
            self.lab.limit_memory(h, self.lab.memory_gb)
        alive = node_alive_addresses(self.lab)
        if self.join_host.address in alive or self.join_host.group.pids():
            self.lab.kill(self.join_host)
        # A host killed a moment ago is still alive to Ray until its health checks lapse: its own
        # processes say it is gone.
        lost = [h for h in self.kept if h.address not in alive or not _runs_raylet(h)]
        for h in lost:
            self.lab.kill(h)   # what is left of a node Ray declared dead
        if lost:
            self.lab.restart_ray(lost, expect=len(self.kept) + 1)
        else:
            self.lab.await_nodes(len(self.kept) + 1)
        return {"hosts": [h.address for h in self.kept]}

    def strike(self, kind: str, host: Host, seconds: float) -> dict:
        if host is self.lab.head:
            raise ValueError(f"{kind} aimed at the head host {host.address}: the run's workers are never there")
        if kind == "kill_node":
            return {"done": "host killed", "processes": self.lab.kill(host)}
        if kind == "freeze":
            self.lab.freeze(host)
            self._later(seconds, self.lab.thaw, host)
            return {"done": "host frozen", "seconds": seconds}
        if kind == "cut":
            self.lab.cut(host)
            self._later(seconds, self.lab.heal, host)
            return {"done": "link cut", "seconds": seconds}
        if kind == "memory_kill":
            return self.memory_kill(host)
        if kind == "drain":
            self._later(seconds, self.lab.kill, host)
            return {"done": "host to be killed at the deadline", "seconds": seconds}
        raise ValueError(f"{kind!r} is not a host's fault; host faults: kill_node, freeze, cut, memory_kill, drain")

    def memory_kill(self, host: Host) -> dict:
        """Pressure on ``host``'s memory until the kernel kills a process there; which one died."""
        group = host.group
        before = group.memory_events()["oom_kill"]
        pids = set(group.pids())
        group.set_memory(group.memory_usage() + _HEADROOM)
        counter = (cgroups.ROOT / "memory" / group.path / "memory.oom_control") if group.v == 1 \
            else (cgroups.ROOT / group.path / "memory.events")
        hog = self.lab.spawn(host, [sys.executable, "-c", _HOG, str(counter), str(before), str(4 << 30)],
                             log="memory_hog")
        try:
            deadline = time.monotonic() + _KILL_WAIT_S
            while group.memory_events()["oom_kill"] <= before and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            hog.kill()
            hog.wait(10)
            self.lab.limit_memory(host, self.lab.memory_gb)
        kills = group.memory_events()["oom_kill"] - before
        # A killed process exits only once its memory is torn down and its parent reaps it: the
        # counter moves first, so wait for the process itself.
        deadline = time.monotonic() + _EXIT_WAIT_S
        gone = _gone(pids)
        while kills and not gone and time.monotonic() < deadline:
            time.sleep(0.05)
            gone = _gone(pids)
        if not kills:
            return {"done": "skipped", "why": f"no OOM kill on {host.address} in {_KILL_WAIT_S:g} s"}
        return {"done": "memory killed", "oom_kills": kills, "pids_gone": gone}

    def _later(self, seconds: float, fn, host: Host) -> None:
        t = threading.Timer(seconds, fn, (host,))
        t.daemon = True
        t.start()
        self._timers.append(t)
        self._undo.append((fn, host))

    def settle(self) -> None:
        """Undo now what still lasts (a freeze, a cut), and take a drained host now."""
        for t in self._timers:
            t.cancel()
        for fn, host in self._undo:
            fn(host)
        self._timers, self._undo = [], []


def _gone(pids: set[int]) -> list[int]:
    """Those of ``pids`` that have exited (a zombie not yet reaped counts as exited)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "X"
        if state in ("Z", "X"):
            out.append(pid)
    return sorted(out)


def _runs_raylet(host: Host) -> bool:
    for pid in host.group.pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"raylet" in f.read():
                    return True
        except OSError:
            pass   # gone meanwhile
    return False


def run_lab_campaign(args: dict, out_dir: str | os.PathLike, say=print, worker_hosts: int = 0,
                     cpus_per_host: float = 0.4, head_cpus: float = 1.0) -> dict:
    """Build a lab, run the campaign's driver on its head with ``args`` (``lab.campaign_driver``'s
    JSON: the setting, the schedules, whether to shrink), carry out its hosts' faults, relay its
    lines to ``say``; then tear the lab down. Returns the driver's report, with what the lab left
    behind (``lab_leftovers``, empty when nothing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    setting = args["setting"]
    hosts = 1 + (worker_hosts or setting["dp"] * setting["pp"] + setting.get("spares", 1)) + 1
    swept = sweep()
    if any(swept.values()):
        say(f"swept an earlier lab's leftovers: {swept}")
    lab = Lab(hosts=hosts, cpus_per_host=cpus_per_host, head_cpus=head_cpus)
    lab_id = lab.id
    try:
        lab.start_ray()
        faults = HostFaults(lab, lab.hosts[-1])
        channel = Channel(out / "channel")
        (out / "args.json").write_text(json.dumps(args))
        lines = out / "lines.txt"
        lines.unlink(missing_ok=True)
        repo = Path(__file__).resolve().parents[1]
        env = {"RAY_ADDRESS": lab.gcs_address, "PYTHONPATH": os.pathsep.join(
            p for p in (str(repo), os.environ.get("PYTHONPATH")) if p)}
        driver = lab.spawn(lab.head, [sys.executable, "-m", "lab.campaign_driver", str(out)], env=env,
                           log="campaign_driver")
        said = 0
        while True:
            ended = driver.poll() is not None
            channel.serve_pending(faults.handle)
            said = _relay(lines, said, say)
            if ended:
                break
            time.sleep(0.02)
        report = out / "report.json"
        if not report.exists():
            log = lab.head.dir / "campaign_driver.log"
            tail = log.read_text()[-4000:] if log.exists() else ""
            raise RuntimeError(f"the campaign's driver ended ({driver.returncode}) without a report; its log "
                               f"ends:\n{tail}")
        doc = json.loads(report.read_text())
    finally:
        lab.close()
    doc["lab_leftovers"] = {k: v for k, v in leftovers(lab_id).items() if v}
    return doc


def _relay(lines: Path, said: int, say) -> int:
    if not lines.exists():
        return said
    text = lines.read_text().splitlines()
    for line in text[said:]:
        say(line)
    return len(text)

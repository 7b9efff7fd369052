"""Carrying a fault out on a simulated cluster (``ray.cluster_utils.Cluster`` on this machine):
a worker's process killed, its node removed without grace, its process frozen and thawed, a
node joined, the S3 server down and back, a node drained (a preemption notice through Ray's
GCS) and removed at its deadline. Each strike returns what it did, for the checker.

Everything struck is this campaign's own: nodes it started, processes of the run's workers
(by pid and start time), the S3 server it runs. A thaw or a return is timed on a thread, so
the run is let go while the fault lasts.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from ...worker.allocator import nodes_start_on
from ...worker.liveness import kill_marked, process_mark
from ..simulate import drain_node, process_tree
from .schedule import DRAINS


class Striker:
    """Strikes faults at the run on ``cluster`` (its removable ``nodes``); ``s3``: the
    ``S3Server`` the run's storage is on (storage outages need it)."""

    def __init__(self, cluster, nodes: list, s3=None):
        self.cluster, self.nodes, self.s3 = cluster, nodes, s3
        self._timers: list[threading.Timer] = []
        self._frozen: list[int] = []
        self._deadlines: list = []
        self._lock = threading.Lock()   # what a drain's deadline does, done at a settle if not yet

    def strike(self, fault, held: dict, workers: list[dict]) -> dict:
        """Carry ``fault`` out; ``held``: the point the run holds at (``FaultPoints.held``);
        ``workers``: the run's workers as its status lists them. What was done."""
        if fault.kind == "join":
            with nodes_start_on("jemalloc"):
                node = self.cluster.add_node(num_cpus=1)
            self.nodes.append(node)
            return {"done": "joined", "node": node.node_id}
        if fault.kind == "storage_outage":
            if self.s3 is None:
                return {"done": "skipped", "why": "the run's storage is not on the campaign's S3 server"}
            self.s3.stop()
            self._later(fault.seconds, self.s3.start)
            return {"done": "storage down", "seconds": fault.seconds}
        victim = victim_of(fault.rank, held, workers)
        if victim is None:
            return {"done": "skipped", "why": f"no worker holds rank {fault.rank} now"}
        out = {"worker": victim["worker_id"], "rank": victim.get("rank"), "node": victim["node_id"],
               "pid": victim["pid"]}
        if fault.kind == "kill_process":
            out["done"] = kill_marked(victim["pid"], victim.get("mark") or process_mark(victim["pid"]))
            return out
        if fault.kind == "kill_node":
            node = next((n for n in self.nodes if n.node_id == victim["node_id"]), None)
            if node is None:
                return {**out, "done": "skipped", "why": "its node is not one the campaign can remove"}
            self.nodes.remove(node)
            self.cluster.remove_node(node, allow_graceful=False)
            return {**out, "done": "node removed"}
        if fault.kind in DRAINS:
            drain_node(victim["node_id"], fault.seconds, f"preempted (campaign {fault.kind})")
            self._at_deadline(fault.seconds, victim)
            return {**out, "done": "drained", "seconds": fault.seconds}
        if fault.kind == "freeze":
            pids = process_tree(victim["pid"])
            for pid in pids:
                _signal(pid, signal.SIGSTOP)
            self._frozen += pids
            self._later(fault.seconds, lambda: self._thaw(pids))
            return {**out, "done": "frozen", "seconds": fault.seconds}
        raise ValueError(f"{fault.kind} is a lab fault: run the campaign with --lab")

    def _at_deadline(self, seconds: float, victim: dict) -> None:
        """The cloud takes a drained node at its deadline, whatever the run did."""
        node = next((n for n in self.nodes if n.node_id == victim["node_id"]), None)
        if node is None:
            return

        def take() -> None:
            with self._lock:   # the timer's thread and a settle may both come
                if node in self.nodes:
                    self.nodes.remove(node)
                    if node in self.cluster.worker_nodes:
                        self.cluster.remove_node(node, allow_graceful=False)
        self._later(seconds, take)
        self._deadlines.append(take)

    def _thaw(self, pids: list[int]) -> None:
        for pid in pids:
            _signal(pid, signal.SIGCONT)
        self._frozen = [p for p in self._frozen if p not in pids]

    def _later(self, seconds: float, fn) -> None:
        t = threading.Timer(seconds, fn)
        t.daemon = True
        t.start()
        self._timers.append(t)

    def settle(self) -> None:
        """Undo what still lasts (a thaw, a return) now: the run is over."""
        for t in self._timers:
            t.cancel()
        self._timers = []
        self._thaw(list(self._frozen))
        for take in self._deadlines:
            take()
        self._deadlines = []
        if self.s3 is not None and not self.s3.running:
            self.s3.start()

    def pending(self) -> bool:
        """Whether a fault still lasts (a freeze not thawed, storage not back)."""
        return any(t.is_alive() for t in self._timers)


def victim_of(rank: int, held: dict, workers: list[dict]) -> dict | None:
    """The worker of ``rank`` now: the one the held set-up gives it, else the one holding it;
    a rank past the plan's size falls on a worker of the plan by turn. (A fence's hold names the
    workers it fenced, a list: the victim is then one of the run's, beside them.)"""
    by_id = {w["worker_id"]: w for w in workers}
    held_workers = held.get("workers")
    setting = {int(r): w for r, w in held_workers.items()} if isinstance(held_workers, dict) else {}
    if setting:
        wid = setting.get(rank, setting[sorted(setting)[rank % len(setting)]])
        return by_id.get(wid)
    ranked = sorted((w for w in workers if w.get("rank") is not None), key=lambda w: w["rank"])
    if not ranked:
        return None
    return next((w for w in ranked if w["rank"] == rank), ranked[rank % len(ranked)])


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def wait_until(pred, timeout_s: float, every_s: float = 0.05) -> bool:
    """Poll ``pred`` until true or ``timeout_s``; whether it came true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every_s)
    return bool(pred())

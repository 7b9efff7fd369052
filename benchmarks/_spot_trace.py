"""The churn trace of ``benchmarks/spot.py``, and its replay against a fleet.

A trace is a seeded list of events on worker *slots* (0..N-1), timed in seconds after the
system under test completed its first step, so that each system meets the same churn however
long its start-up took:

- ``preempt``: a preemption notice for the slot's node; the node dies ``notice_s`` later;
- ``kill``: the slot's node dies without notice;
- ``replace``: a new node fills the slot (the autoscaler's replacement, after a delay).

A fleet says what each event does to one system: the Ray fleet drains nodes through the GCS
(``DrainNode``, reason PREEMPTION, as ``ray drain-node`` and Ray's cloud integrations do) and
kills them with ``remove_node(allow_graceful=False)``; torchft's fleet has no notice path and
kills a replica group's process at the node's death.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Event:
    at_s: float
    kind: str          # "preempt" | "kill" | "replace"
    slot: int
    notice_s: float = 0.0

    @property
    def dies_at_s(self) -> float:
        return self.at_s + self.notice_s


def make_trace(seed: int, duration_s: float = 600.0, slots: int = 4, mean_gap_s: float = 75.0,
               without_notice: float = 0.25, notices=(30.0, 120.0), replace_after=(20.0, 60.0),
               quiet_end_s: float = 30.0) -> list[Event]:
    """Seeded churn over ``duration_s``: losses at exponential gaps (mean ``mean_gap_s``), a
    share ``without_notice`` of them without notice, the others with one of ``notices``
    (the two common clouds' windows); each lost node replaced ``replace_after`` seconds after it
    died. At most ``slots - 1`` slots are down at once, and nothing starts in the last
    ``quiet_end_s`` seconds."""
    rng = random.Random(seed)
    events: list[Event] = []
    down_until = {s: -1.0 for s in range(slots)}   # when each slot's replacement is up
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mean_gap_s)
        if t > duration_s - quiet_end_s:
            break
        up = [s for s in range(slots) if down_until[s] <= t]
        if len(up) <= 1:
            continue
        slot = rng.choice(up)
        if rng.random() < without_notice:
            ev = Event(round(t, 1), "kill", slot)
        else:
            ev = Event(round(t, 1), "preempt", slot, rng.choice(notices))
        back = round(ev.dies_at_s + rng.uniform(*replace_after), 1)
        events += [ev, Event(back, "replace", slot)]
        down_until[slot] = back
    return sorted(events, key=lambda e: (e.at_s, e.kind != "replace"))


def trace_line(trace: list[Event]) -> str:
    losses = [e for e in trace if e.kind != "replace"]
    notice = [e for e in losses if e.kind == "preempt"]
    return (f"{len(losses)} losses ({len(notice)} with notice "
            f"{sorted({e.notice_s for e in notice})} s, {len(losses) - len(notice)} without), "
            f"{len(trace) - len(losses)} replacements")


def dump(trace: list[Event]) -> list[dict]:
    return [asdict(e) for e in trace]


class Fleet:
    """What a trace's events do to one system. Subclasses do the three actions."""

    def notice(self, slot: int, deadline_s: float) -> None:
        raise NotImplementedError

    def kill(self, slot: int) -> None:
        raise NotImplementedError

    def replace(self, slot: int) -> None:
        raise NotImplementedError


class RayFleet(Fleet):
    """Slots as one-node-per-slot on a ``ray.cluster_utils.Cluster``."""

    def __init__(self, cluster, nodes: list, node_args: dict | None = None):
        self.cluster = cluster
        self.nodes = list(nodes)
        self.node_args = node_args or {"num_cpus": 1}

    def notice(self, slot: int, deadline_s: float) -> None:
        from elastic_trainer.chaos.simulate import drain_node

        drain_node(self.nodes[slot].node_id, deadline_s, "preempted (spot trace)", address=self.cluster.address)

    def kill(self, slot: int) -> None:
        node = self.nodes[slot]
        if node is not None and node in self.cluster.worker_nodes:
            self.cluster.remove_node(node, allow_graceful=False)
        self.nodes[slot] = None

    def replace(self, slot: int) -> None:
        # Added from the replayer's thread: a node started with exit hooks would register a
        # signal handler (only the main thread may) and its processes would ask the kernel to
        # kill them when the thread that forked them ends. ``cluster.shutdown()`` still ends it.
        hooks, self.cluster._shutdown_at_exit = self.cluster._shutdown_at_exit, False
        try:
            self.nodes[slot] = self.cluster.add_node(**self.node_args)
        finally:
            self.cluster._shutdown_at_exit = hooks


class Replayer:
    """Plays a trace on a fleet from the moment ``begin()`` is called (the system's first step),
    on a thread of its own; ``log`` records what was done and when (wall clock)."""

    def __init__(self, trace: list[Event], fleet: Fleet):
        self.trace = trace
        self.fleet = fleet
        self.log: list[dict] = []
        self._t0: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self) -> None:
        if self._thread is None:
            self._t0 = time.time()
            self._thread = threading.Thread(target=self._play, name="spot-trace", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _actions(self) -> list[tuple[float, str, Event]]:
        out = []
        for e in self.trace:
            if e.kind == "preempt":
                out += [(e.at_s, "notice", e), (e.dies_at_s, "kill", e)]
            else:
                out.append((e.at_s, "kill" if e.kind == "kill" else "replace", e))
        return sorted(out, key=lambda a: a[0])

    def _play(self) -> None:
        for at, what, e in self._actions():
            if self._stop.wait(max(0.0, self._t0 + at - time.time())):
                return
            started = time.time()
            try:
                if what == "notice":
                    self.fleet.notice(e.slot, e.notice_s)
                elif what == "kill":
                    self.fleet.kill(e.slot)
                else:
                    self.fleet.replace(e.slot)
                error = None
            except Exception as exc:  # noqa: BLE001 - a failed action is recorded, the trace goes on
                error = repr(exc)
            self.log.append({"at_s": round(started - self._t0, 2), "action": what, "slot": e.slot,
                             "event": asdict(e), "time": started, "error": error})


def measure(records: list[dict], wall_start: float, wall_end: float, ckpt_key: str = "ckpt_s",
            same_s: float = 0.005) -> dict:
    """Goodput from the outside, the same for every system: ``records`` are the completed steps
    in completion order, each ``{"step", "start", "end"}`` (wall clock) and optionally the
    seconds of it spent checkpointing (``ckpt_key``). A step done more than once counts once
    (its last completion); the earlier completions are redone time.

    Steps that end together (within ``same_s``: a batch of steps reported at once, such as a
    lease's) are one span as long as their durations added; spans that overlap (a batch issued
    before the last one ended) count their overlap once, so the effective time is the part of
    the wall clock covered by counted steps."""
    last: dict[int, dict] = {}
    for r in records:
        last[r["step"]] = r
    counted = set(map(id, last.values()))
    groups: list[list[dict]] = []
    for r in sorted((r for r in records if id(r) in counted), key=lambda r: r["end"]):
        if groups and r["end"] - groups[-1][-1]["end"] <= same_s:
            groups[-1].append(r)
        else:
            groups.append([r])
    effective = ckpt = 0.0
    covered = wall_start
    for g in groups:
        end = max(r["end"] for r in g)
        span = sum(max(0.0, r["end"] - r["start"]) for r in g)
        length = max(0.0, end - max(end - span, covered))
        covered = max(covered, end)
        c = min(length, sum(float(r.get(ckpt_key) or 0.0) for r in g))
        effective += length - c
        ckpt += c
    redone = sum(max(0.0, r["end"] - r["start"]) for r in records if id(r) not in counted)
    wall = wall_end - wall_start
    first = min((r["end"] - sum(x["end"] - x["start"] for x in g) for g in groups[:1] for r in g[:1]),
                default=wall_end)
    last_end = max((r["end"] for r in records), default=wall_end)
    startup = max(0.0, first - wall_start)
    finish = max(0.0, wall_end - last_end)
    between = wall - effective - ckpt - redone - startup - finish
    return {"wall_s": wall, "effective_s": effective, "goodput": effective / wall if wall > 0 else 0.0,
            "lost_s": wall - effective, "steps": len(last), "steps_redone": len(records) - len(last),
            "time_to_last_step_s": last_end - wall_start,
            "lost_by_bucket": {"start-up": startup, "between steps (recovery, restarts, waits)": between,
                               "redone steps": redone, "checkpointing": ckpt, "finish": finish}}


def write_jsonl(path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def read_jsonl(path) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []

"""torchft under the spot churn of ``benchmarks/spot.py``: fault-tolerant DDP without restarts.

Setup, as torchft's ``train_ddp.py`` and README intend (torchft 0.2.0):

- one lighthouse process (torchft's Rust lighthouse through ``torchft.coordination.
  LighthouseServer``, what the ``torchft_lighthouse`` console script runs, on 127.0.0.1) with
  ``LIGHTHOUSE`` below: ``min_replicas=1`` (the trace may leave one slot up), a quorum check every
  100 ms, a replica dead after 1 s without heartbeat (its Manager beats every 100 ms) and 2 s
  of waiting for heartbeating stragglers to join a non-fast quorum;
- 4 replica groups of one process each (``_spot_torchft_worker.py``), dp=4 x pp=1 over gloo on
  127.0.0.1, the demo GPT and data of ``_ray_train_recovery.py``, one torch thread each; each
  runs a ``Manager`` (``TIMEOUTS`` below: synchronous quorum, ``min_replica_size=1``),
  ``DistributedDataParallel`` and ``OptimizerWrapper``. The global batch stays constant at any
  number of live groups (each group takes its share of the step's samples, see the worker).
- ``ProcessFleet``: no notice path (a notice does nothing); a node's death SIGKILLs the slot's
  group process (its process group); a replacement starts a new group that joins at the next
  quorum and heals from a live peer (``PGTransport``). Nothing durable is checkpointed.

torchft 0.2.0's ``DistributedDataParallel`` crashes every surviving group when a peer dies in an
all-reduce (its comm hook asserts on the failed work); the worker uses it with that hook fixed
(see ``_ddp_class`` there), which is what lets the run go on through losses at all.

What it measures: every group logs every step attempt. Per (step, quorum) the first group's
commit is the system's step (all groups of a quorum commit the same step); an attempt that no
group of its quorum committed (``should_commit()`` false: a peer died in the all-reduce) is a
redone step. A step starts at its quorum request when the quorum is the group's previous one
(steady state: the per-step quorum round trip is step time), and once the new quorum is
configured (and the group healed) when it changed, so that waiting for a dead peer's heartbeat
to expire (or for a survivor stuck in the failed all-reduce), reconfiguring gloo and healing
count as time between steps. Its loss is the global batch's (share-weighted over the groups).
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _spot_trace import Fleet, Replayer, measure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_spot_torchft_worker.py")
GROUPS = 4
LIGHTHOUSE = {"min_replicas": 1, "quorum_tick_ms": 100, "heartbeat_timeout_ms": 1000, "join_timeout_ms": 2000}
# Manager: timeout (collectives, should_commit, checkpoint transfer), quorum_timeout (waiting for
# the lighthouse), connect_timeout (RPC connections); pg_s: gloo's own timeout (train_ddp.py's
# 5 s), which bounds a survivor's wait in an all-reduce whose data was to come from a peer that
# has itself given up on the step (it then waits in the quorum for that survivor).
TIMEOUTS = {"pg_s": 5, "manager_s": 10, "quorum_s": 60, "connect_s": 10}
POLL_S = 0.1
MAX_RESTARTS = 4   # groups that die on their own (not by the trace) are restarted, as torchrun would


def _killpg(p: subprocess.Popen) -> None:
    """SIGKILL a process we started in a session of its own, and its children; reap it."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


class ProcessFleet(Fleet):
    """Slots as replica-group processes; ``spawn(slot, join)`` starts one and returns its Popen."""

    def __init__(self, spawn):
        self._spawn = spawn
        self.procs: dict[int, subprocess.Popen] = {}
        self.started: list[subprocess.Popen] = []
        self.killed: set[int] = set()        # pids the trace killed
        self.restarts: list[dict] = []       # groups that died on their own, restarted
        self._lock = threading.Lock()
        self._closed = False

    def start(self, slot: int, join: bool) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the run is over")
            p = self._spawn(slot, join)
            self.procs[slot] = p
            self.started.append(p)

    def notice(self, slot: int, deadline_s: float) -> None:
        pass  # torchft has no notice path: the group trains until its node dies

    def kill(self, slot: int) -> None:
        with self._lock:
            p = self.procs.pop(slot, None)
            if p is not None:
                self.killed.add(p.pid)
                _killpg(p)

    def replace(self, slot: int) -> None:
        self.start(slot, join=True)

    def restart_crashed(self) -> None:
        """A group that exits on its own with an error is restarted (torchrun's max_restarts)."""
        for slot, p in list(self.procs.items()):
            if p.poll() not in (None, 0) and p.pid not in self.killed:
                with self._lock:
                    self.procs.pop(slot, None)
                self.restarts.append({"slot": slot, "pid": p.pid, "rc": p.returncode, "time": time.time()})
                if len(self.restarts) > MAX_RESTARTS:
                    raise RuntimeError(f"replica groups died on their own {len(self.restarts)} times "
                                       f"(last: slot {slot}, rc {p.returncode}): see the group-*.log files")
                self.start(slot, join=True)

    def close(self, grace_s: float = 0.0, finishing: frozenset = frozenset()) -> None:
        """Kill every group still running; those in ``finishing`` (pids) get ``grace_s`` to exit."""
        with self._lock:
            self._closed = True
        deadline = time.time() + grace_s
        for p in self.started:
            while p.pid in finishing and p.poll() is None and time.time() < deadline:
                time.sleep(0.02)
            _killpg(p)


class _Tail:
    """New complete JSON lines of the groups' step logs, read incrementally."""

    def __init__(self, d: Path):
        self.d, self.off, self.recs = d, {}, []

    def poll(self) -> list[dict]:
        new = []
        for p in sorted(self.d.glob("steps-*.jsonl")):
            with open(p, "rb") as f:
                f.seek(self.off.get(p, 0))
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            if end:
                self.off[p] = self.off.get(p, 0) + end
                new += [json.loads(line) for line in chunk[:end].splitlines() if line.strip()]
        self.recs += new
        return new


def system_records(recs: list[dict]) -> tuple[list[dict], int]:
    """The run's step attempts for ``measure``, in completion order, and how many failed: one per
    (step, quorum), the first group's commit if a group of that quorum committed it, else the
    first failed attempt (a redone step); its loss is the global batch's, the share-weighted mean
    of the committing groups' losses. Were every group lost at once, the steps trained again
    from scratch fall in later quorums, and ``measure`` counts their first lives as redone."""
    chosen: dict = {}
    losses: dict = {}   # (step, quorum) -> [loss * share] of the groups that committed it
    for r in recs:
        if r.get("event") != "step":
            continue
        key = (r["step"], r["quorum_id"])
        if r["committed"]:
            losses.setdefault(key, []).append((r["loss"] * r["share"], r["share"]))
        have = chosen.get(key)
        if have is None or (r["committed"], -r["end"]) > (have["committed"], -have["end"]):
            chosen[key] = r
    out = []
    for key, r in chosen.items():
        start = r["t_quorum"] if not r["quorum_changed"] else r["start_compute"]
        parts = losses.get(key, [(r["loss"] * r["share"], r["share"])])
        out.append({"step": r["step"], "start": start, "end": r["end"], "ckpt_s": 0, "world": r["world"],
                    "group": r["group"], "committed": r["committed"],
                    "loss": sum(a for a, _ in parts) / sum(b for _, b in parts)})
    out.sort(key=lambda r: r["end"])
    return out, sum(1 for r in out if not r["committed"])


def _start_lighthouse(work: Path, env: dict) -> tuple[subprocess.Popen, str]:
    """torchft's lighthouse in a process of its own (its Python API, bound to 127.0.0.1)."""
    port_file = work / "lighthouse.port"
    port_file.unlink(missing_ok=True)
    args = json.dumps({"options": LIGHTHOUSE, "port_file": str(port_file)})
    with open(work / "lighthouse.log", "ab") as out:
        p = subprocess.Popen([sys.executable, str(WORKER), "--lighthouse", args], cwd=ROOT, env=env,
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 60
    while not port_file.exists():
        if p.poll() is not None or time.time() > deadline:
            _killpg(p)
            raise RuntimeError(f"the torchft lighthouse did not start (rc {p.returncode}); see {work}/lighthouse.log")
        time.sleep(0.1)
    return p, f"http://127.0.0.1:{port_file.read_text().strip()}"


def _over_time(records: list[dict], t0: float) -> list[list]:
    """[seconds after ``t0`` (the trace's start), participants] at every change of the committed
    steps' world."""
    out: list[list] = []
    for r in records:
        if r["committed"] and (not out or out[-1][1] != r["world"]):
            out.append([round(r["end"] - t0, 2), r["world"]])
    return out


def run_torchft_spot(raw: dict, trace: list, steps: int, workdir: str, *, timeout_s: float | None = None) -> dict:
    """Train the demo GPT under torchft at dp=4 x pp=1 while ``trace`` plays (from the first
    committed step) until ``steps`` steps are committed; ``measure`` of the run plus
    ``failed_commits`` (attempts no group committed; ``_by_group``: every group's), ``worlds``
    (participants of committed steps), ``participants_over_time`` ([s after the first step,
    participants]), ``heals``, ``group_restarts``, ``trace_log``/``trace_played`` and the
    ``losses`` of the committed steps. ``workdir`` gets the logs (its old ones are removed);
    ``timeout_s`` (default: the trace's last event + 600 s) raises TimeoutError."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    for old in itertools.chain(work.glob("steps-*.jsonl"), work.glob("group-*"), work.glob("lighthouse.*")):
        old.unlink()
    ready = work / "ready"
    shutil.rmtree(ready, ignore_errors=True)
    ready.mkdir()
    raw = copy.deepcopy(raw)
    raw["parallel"] = {**raw.get("parallel", {}), "dp": GROUPS, "pp": 1}
    raw.setdefault("train", {})["steps"] = steps
    if raw.get("scaling", {}).get("num_workers") is not None:
        raw["scaling"]["num_workers"] = GROUPS
    if timeout_s is None:
        timeout_s = max((e.at_s + e.notice_s for e in trace), default=0.0) + 600.0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    seq = itertools.count()
    lighthouse: subprocess.Popen | None = None
    addr = ""

    def spawn(slot: int, join: bool) -> subprocess.Popen:
        n = next(seq)
        args = {"slot": slot, "join": join, "cfg": raw, "steps": steps, "lighthouse": addr,
                "log": str(work / f"steps-{slot}-{n}.jsonl"), "ready_dir": str(ready), "initial": GROUPS,
                "min_replicas": LIGHTHOUSE["min_replicas"], "timeouts": TIMEOUTS}
        (work / f"group-{slot}-{n}.json").write_text(json.dumps(args))
        with open(work / f"group-{slot}-{n}.log", "ab") as out:
            return subprocess.Popen([sys.executable, str(WORKER), str(work / f"group-{slot}-{n}.json")],
                                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    fleet = ProcessFleet(spawn)
    replayer = Replayer(trace, fleet)
    tail = _Tail(work)
    wall_start = time.time()
    try:
        lighthouse, addr = _start_lighthouse(work, env)
        for slot in range(GROUPS):
            fleet.start(slot, join=False)
        first = top = 0
        while top < steps:
            time.sleep(POLL_S)
            for r in tail.poll():
                if r.get("event") == "step" and r["committed"]:
                    top = max(top, r["step"])
                    first = first or r["end"]
            if first:
                replayer.begin()
            fleet.restart_crashed()
            if time.time() - wall_start > timeout_s:
                raise TimeoutError(f"torchft committed {top} of {steps} steps in {timeout_s:.0f} s; logs in {work}")
        replayer.stop()
        # the groups that committed the last step exit by themselves; a late joiner is killed
        done = frozenset(r["pid"] for r in tail.recs if r.get("event") == "step" and r["step"] >= steps)
        fleet.close(grace_s=5.0, finishing=done)
    finally:
        replayer.stop()
        fleet.close()
        if lighthouse is not None:
            _killpg(lighthouse)
    wall_end = time.time()
    tail.poll()
    records, failed = system_records(tail.recs)
    heals = [r for r in tail.recs if r.get("event") == "heal"]
    out = measure(records, wall_start, wall_end)
    out.update({
        "system": "torchft (lighthouse + Manager, DDP over gloo)",
        "failed_commits": failed,
        "failed_commits_by_group": sum(1 for r in tail.recs if r.get("event") == "step" and not r["committed"]),
        "worlds": sorted({r["world"] for r in records if r["committed"]}),
        "steps_recommitted": sum(r["committed"] for r in records) - len({r["step"] for r in records if r["committed"]}),
        "participants_over_time": _over_time(records, getattr(replayer, "_t0", None) or wall_start),
        "heals": [{"group": h["group"], "to_step": h["to_step"], "heal_s": round(h["heal_s"], 3),
                   "world": h["world"]} for h in heals],
        "group_restarts": fleet.restarts,
        "trace_log": replayer.log,
        "trace_played": f"{len(replayer.log)} of {len(replayer._actions())} actions",
        "losses": [r["loss"] for r in records if r["committed"]],
        "settings": {"lighthouse": LIGHTHOUSE, "timeouts": TIMEOUTS, "groups": GROUPS, "quorum": "synchronous"},
    })
    return out

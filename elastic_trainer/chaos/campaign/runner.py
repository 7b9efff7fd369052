"""Runs one fault schedule against a real run on a simulated cluster and keeps what it left.

The run is the product's own (``Trainer.fit`` with the config given); the campaign only arms
the run's fault points (``controller.run.fault_points``) and, each time the run holds at the
armed one, strikes the fault (``strike``), arms the next and lets the run go on. What comes
back (``Outcome``) is everything the checker needs: how the run ended, its history and
events, its final state, the faults as struck, and the workers' processes it saw.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

import ray

from ...naming import NAMESPACE
from ...trainer import Trainer
from .schedule import KILLS, Schedule
from .strike import Striker, wait_until

_POLL_S = 0.05
# After a kill or a join, the run waits between steps for the pool to be whole, up to this long in all.
_JOIN_WAIT_S = 60.0


@dataclass
class Outcome:
    """What a run under a schedule left."""

    schedule: Schedule
    state: str                         # FINISHED | STOPPED | FAILED | HUNG
    error: str | None = None
    history: list = field(default_factory=list)
    events: list = field(default_factory=list)
    model_state: dict | None = None
    durable_path: str | None = None
    run_id: str | None = None
    plans: list = field(default_factory=list)
    goodput: dict | None = None        # where the run's wall time went (``Result.goodput``)
    struck: list = field(default_factory=list)      # per fault struck: its line, the point held, what was done
    unstruck: list = field(default_factory=list)    # faults whose point the run never reached
    processes: dict = field(default_factory=dict)   # worker id -> (pid, start mark) of every worker seen
    leftovers: list = field(default_factory=list)   # what outlived the run (filled by ``run_schedule``)
    seconds: float = 0.0


def run_schedule(cfg, schedule: Schedule, striker: Striker, deadline_s: float = 300.0) -> Outcome:
    """Run ``cfg`` (fault injection allowed) under ``schedule``; its ``Outcome``. A run that has
    not ended within ``deadline_s`` is stopped and reported HUNG."""
    if not cfg.failure.allow_fault_injection:
        raise ValueError("a campaign's run needs failure.allow_fault_injection: true")
    pending = collections.deque(schedule.faults)
    out = Outcome(schedule, "FAILED")
    box: dict = {}
    ctl: list = []
    armed: dict = {}   # (point, pass number) -> what holds there: "fault", or "await" (a new worker)
    world = cfg.max_workers

    def arm(point: str, occurrence: int, what: str) -> None:
        armed[(point, ray.get(ctl[0].fault_point.remote("arm", point, occurrence)))] = what

    def on_start(controller) -> None:
        ctl.append(controller)
        if pending:
            arm(pending[0].point, pending[0].occurrence, "fault")

    def fit() -> None:
        try:
            box["result"] = Trainer(cfg, verbose=False, on_start=on_start).fit(return_model_state=True)
        except BaseException as e:  # noqa: BLE001 - the outcome says how the run ended
            box["error"] = e

    t0 = time.monotonic()
    thread = threading.Thread(target=fit, name=f"campaign-{cfg.run.name}", daemon=True)
    thread.start()
    last_look, awaiting = 0.0, None
    killed, killed_nodes = set(), set()
    while thread.is_alive():
        thread.join(_POLL_S)
        if not ctl:
            continue
        try:
            held = ray.get(ctl[0].fault_point.remote("held"), timeout=10)
            if held or time.monotonic() - last_look > 0.5:
                workers = ray.get(ctl[0].status.remote(), timeout=10)["workers"]
                last_look = time.monotonic()
                for w in workers:
                    out.processes.setdefault(w["worker_id"], (w["pid"], w.get("mark")))
        except Exception:  # noqa: BLE001 - the controller ended (or is ending): the join says how
            continue
        if held:
            what = armed.pop((held["point"], held["occurrence"]), None)
            if what == "fault" and pending:
                fault = pending.popleft()
                done = striker.strike(fault, held, workers)
                out.struck.append({"fault": fault.line(), "kind": fault.kind, "point": held["point"],
                                   "step": held.get("step"), "time": time.time(), **done})
                if pending:
                    arm(pending[0].point, pending[0].occurrence, "fault")
                if fault.kind in KILLS and done.get("worker") is not None and done["done"] != "skipped":
                    # Still listed until the run sees it gone (a lease in flight may not have yet).
                    killed.add(done["worker"])
                    if fault.kind == "kill_node":
                        killed_nodes.add(done["node"])
                if fault.kind in KILLS + ("join",) and awaiting is None:
                    awaiting = time.monotonic() + _JOIN_WAIT_S
                    arm("between_steps", 1, "await")
            elif what == "await" and awaiting:
                # A worker that takes a lost one's place (on its free node, or a spare or joined one)
                # takes seconds to start, longer than a tiny run's steps (a lease may run all that is
                # left): the run waits between steps until it is up (as on a run whose steps take
                # seconds), so the grow back happens, and a fault drawn for that grow finds it.
                alive = [w for w in workers if w["worker_id"] not in killed and w["node_id"] not in killed_nodes]
                if len(alive) >= world or time.monotonic() > awaiting:
                    awaiting = None
                else:
                    _await_new_worker(ctl[0], awaiting, cfg.scaling.grow_check_s)
                    arm("between_steps", 1, "await")
            ray.get(ctl[0].fault_point.remote("release"))
        if time.monotonic() - t0 > deadline_s:
            out.state = "HUNG"
            try:
                ray.get(ctl[0].stop.remote("the campaign's deadline"), timeout=10)
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass
            thread.join(60)
            if thread.is_alive():
                ray.kill(ctl[0], no_restart=True)
                thread.join(30)
            break
    striker.settle()
    out.seconds = time.monotonic() - t0
    out.unstruck = [f.line() for f in pending]
    result, error = box.get("result"), box.get("error")
    if result is not None:
        out.state = result.state if out.state != "HUNG" else "HUNG"
        out.history, out.events, out.model_state = result.history, result.events, result.model_state
        out.durable_path, out.run_id, out.plans = result.durable_path, result.run_id, result.plans
        out.goodput = result.goodput
    elif error is not None:
        out.state = "FAILED" if out.state != "HUNG" else "HUNG"
        out.error = f"{type(error).__name__}: {error}"
        out.history = list(getattr(error, "history", []) or [])
        out.events = list(getattr(error, "events", []) or [])
    out.leftovers = leftovers(cfg.run.name, out.processes)
    return out


def _await_new_worker(controller, until: float, look_s: float) -> None:
    """Hold the run (it holds between steps) until a worker it started is up, then long enough
    that its next look for workers (every ``look_s``) takes it in; when none is starting, just
    that long, so that look starts one where a node is free. Never past ``until``."""
    held = time.monotonic()
    while time.monotonic() < until:
        time.sleep(_POLL_S)
        try:
            starting = ray.get(controller.status.remote(), timeout=10).get("starting") or []
        except Exception:  # noqa: BLE001 - the controller ended meanwhile: the run's join says how
            return
        if time.monotonic() - held < look_s:
            continue
        if not starting or any(w["ready"] for w in starting):
            return


def leftovers(run_name: str, processes: dict, wait_s: float = 30.0) -> list[str]:
    """What of the run still exists once it ended (waited for up to ``wait_s``, since a killed
    actor's process takes a moment to go): its named actors, its workers' processes, placement
    groups."""
    from ...worker.liveness import running

    def left() -> list[str]:
        found = [f"actor {a['name']}" for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == NAMESPACE and a["name"].startswith(f"{run_name}-")]
        found += [f"worker {wid}'s process {pid}" for wid, (pid, mark) in sorted(processes.items())
                  if mark is not None and running(pid, mark) is not None]
        # The runtime makes no placement group; any left in the cluster is one it should not have.
        found += [f"placement group {pg_id[:12]}" for pg_id, pg in ray.util.placement_group_table().items()
                  if pg.get("state") not in ("REMOVED", None)]
        return found

    wait_until(lambda: not left(), wait_s, every_s=0.2)
    return left()

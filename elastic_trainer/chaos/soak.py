"""A chaos soak on a simulated cluster: node losses at seeded random moments, nodes added.

Five losses, where recovery code is hardest to get right: one while the
first workers are set up (before step 1), a plain one followed by one while
its recovery's set-up is under way, one while a snapshot is being copied, and
one while a durable checkpoint is being written. Two nodes join at random
steps, so the run grows back. Everything is decided by
``seed``: print it, and a failure can be replayed.

The run's config must allow fault injection (``failure.allow_fault_injection``)
and hold every first set-up a little (``SETUP_DELAY_ENV`` in
``scaling.env_vars``), so that the start-up loss has a start-up to hit. A
model that steps in milliseconds is over before a joined node's worker has
started: hold each snapshot a little too (``SNAPSHOT_DELAY_ENV``, with a
snapshot every step) and pass that hold as ``snapshot_delay_s``.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import ray

from ..naming import NAMESPACE, controller_name


@dataclass
class SoakPlan:
    """When each action happens: the step after which it starts (seen by ``on_step``)."""

    seed: int
    recovery_loss_at: int
    snapshot_loss_from: int
    durable_loss_at: int
    adds_at: list[int]
    durable_every: int = 20

    @classmethod
    def draw(cls, seed: int, steps: int, durable_every: int) -> "SoakPlan":
        """Moments spread over the run, one action per stretch so that each recovery is over
        before the next loss (the durable loss at a durable step). Nodes join early enough
        for their workers to start (seconds) while the run still goes."""
        rng = random.Random(seed)

        def at(lo: float, hi: float) -> int:
            return rng.randint(int(steps * lo), int(steps * hi))

        durable = max(durable_every, (at(0.50, 0.62) // durable_every) * durable_every)
        return cls(seed=seed, recovery_loss_at=at(0.08, 0.18), snapshot_loss_from=at(0.28, 0.40),
                   durable_loss_at=durable, adds_at=sorted([at(0.18, 0.24), at(0.42, 0.48)]),
                   durable_every=durable_every)


@dataclass
class Soak:
    """Drives a :class:`SoakPlan` against a run on ``cluster`` (a ``ray.cluster_utils.Cluster``):
    call :meth:`start` before ``fit`` and pass :meth:`on_step` as its ``on_step``."""

    cluster: object
    nodes: list
    run_name: str
    plan: SoakPlan
    log: list[dict] = field(default_factory=list)   # what was done, when, to which node
    snapshot_delay_s: float = 0.0   # the run's own slow-snapshot hold, restored after the snapshot loss
    _done: set = field(default_factory=set)
    _snapshot_armed: bool = False
    # After an add, no loss until the run has grown onto the new node (its plan index moved) or
    # GROW_WAIT_S passed: a joined node's worker takes seconds to start, and a loss in between
    # would leave the soak's growth to the machine's speed.
    _awaiting_growth: tuple | None = None

    def __post_init__(self):
        self._rng = random.Random(self.plan.seed + 1)
        self._lock = threading.Lock()

    # -- the cluster -------------------------------------------------------------------
    def _status(self) -> dict:
        return ray.get(ray.get_actor(controller_name(self.run_name), namespace=NAMESPACE).status.remote())

    def _kill(self, what: str, among: list[int] | None = None) -> None:
        """Remove the node of a worker (one of ``among``, else one holding a rank), at random."""
        st = self._status()
        ranked = [w for w in st["workers"] if (w["worker_id"] in among if among else w["rank"] is not None)]
        if not ranked:
            return
        victim = self._rng.choice(sorted(ranked, key=lambda w: w["worker_id"]))
        node = next((n for n in self.nodes if n.node_id == victim["node_id"]), None)
        if node is None:
            return
        with self._lock:
            self.nodes.remove(node)
            self.log.append({"action": "loss", "what": what, "step": st["step"], "state": st["state"],
                             "worker": victim["worker_id"], "rank": victim["rank"], "time": time.time()})
        self.cluster.remove_node(node, allow_graceful=False)

    def _add(self) -> None:
        node = self.cluster.add_node(num_cpus=1)
        with self._lock:
            self.nodes.append(node)
            self.log.append({"action": "add", "step": self._status()["step"], "time": time.time()})

    def _inject_all(self, kind: str, **kw) -> None:
        """``inject_fault(kind, **kw)`` on every live worker of the run, found by id."""
        ctl = ray.get_actor(controller_name(self.run_name), namespace=NAMESPACE)
        for h in ray.get(ctl.worker_handles.remote()):
            try:
                ray.get(h.inject_fault.remote(kind, **kw), timeout=5)
            except Exception:  # noqa: BLE001 - a worker that went meanwhile
                pass

    # -- the losses --------------------------------------------------------------------
    def start(self) -> None:
        """The start-up loss: a node goes while the first plan is being set up."""
        def kill_at_start_up():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    st = self._status()
                except ValueError:   # the controller is not up yet
                    time.sleep(0.05)
                    continue
                if st["setting_up"] and st["step"] == 0:
                    self._kill("start-up", among=list(st["setting_up"]["workers"].values()))
                    return
                time.sleep(0.05)

        threading.Thread(target=kill_at_start_up, daemon=True).start()

    def _during_recovery(self) -> None:
        # Every survivor's next set-up holds 2 s, so the recovery lasts long enough to be hit.
        self._inject_all("slow_setup", seconds=2.0)
        self._kill("first of two")

        def second():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                up = self._status().get("setting_up")
                if up:
                    self._kill("during a recovery", among=list(up["workers"].values()))
                    return
                time.sleep(0.02)

        threading.Thread(target=second, daemon=True).start()

    GROW_WAIT_S = 30.0

    def on_step(self, rec: dict) -> None:
        step, p = rec["step"], self.plan
        if self._awaiting_growth is not None:
            plan_at_add, deadline = self._awaiting_growth
            if rec.get("plan", 0) <= plan_at_add and time.monotonic() < deadline:
                return
            self._awaiting_growth = None
            if "durable" not in self._done and step >= p.durable_loss_at - 4:
                # The durable step passed while waiting: the loss goes to the next durable write.
                p.durable_loss_at = (step + 4 + p.durable_every) // p.durable_every * p.durable_every
                self._done.discard("durable-armed")
        for name, when, action in (
                ("recovery", p.recovery_loss_at, self._during_recovery),
                ("durable-armed", p.durable_loss_at - 4, lambda: self._slow_durable(3.0)),
                ("durable", p.durable_loss_at, self._during_durable),
                *((f"add{i}", s, self._add) for i, s in enumerate(p.adds_at))):
            if step >= when and name not in self._done:
                self._done.add(name)
                action()
                if name.startswith("add"):
                    self._awaiting_growth = (rec.get("plan", 0), time.monotonic() + self.GROW_WAIT_S)
                    return
        if step >= p.snapshot_loss_from and "snapshot" not in self._done:
            if not self._snapshot_armed:
                # Every snapshot's copy now holds 1 s: the next one is under way when seen.
                self._snapshot_armed = True
                self._inject_all("slow_snapshot", seconds=1.0)
            elif rec.get("snapshot"):
                self._done.add("snapshot")
                self._kill("during a snapshot")
                self._inject_all("slow_snapshot", seconds=self.snapshot_delay_s)

    def _slow_durable(self, seconds: float) -> None:
        ctl = ray.get_actor(controller_name(self.run_name), namespace=NAMESPACE)
        ray.get(ctl.inject_fault.remote("slow_durable", seconds=seconds))

    def _during_durable(self) -> None:
        # The durable write of this step began beside the loop and holds 3 s (armed 4 steps ago).
        self._kill("during a durable write")
        self._slow_durable(0.0)

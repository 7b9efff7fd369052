"""The controller actor: one per run. Owns the plan, the workers, and the step loop.

It moves through explicit states (``RunState``); every transition is recorded
with its time so the run's story can be read back from ``result.events``.
"""

from __future__ import annotations

import enum
import threading
import time

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..config import TrainerConfig
from ..errors import WorkerError
from ..worker.actor import TrainWorker
from .placement import Placement, place_workers
from .plan import Plan, make_plan


class RunState(str, enum.Enum):
    PENDING = "PENDING"
    PLACING = "PLACING"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"


# Slack on top of the collective timeout: a step's results must arrive within
# the time its collectives are allowed, plus the work between them.
_STEP_SLACK_S = 60.0


class Controller:
    def __init__(self, cfg_json: dict, run_name: str):
        self.cfg = TrainerConfig.model_validate(cfg_json)
        self.cfg_json = cfg_json
        self.run_name = run_name
        self.state = RunState.PENDING
        self.events: list[dict] = []
        self.history: list[dict] = []
        self.plan: Plan | None = None
        self.placement: Placement | None = None
        self.workers: list = []
        self.worker_info: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()

    # -- queried by the driver while run() is in progress ------------------------
    def progress(self, since: int) -> dict:
        with self._lock:
            return {"state": self.state.value, "records": self.history[since:],
                    "plan": self.plan.describe() if self.plan else None}

    def status(self) -> dict:
        with self._lock:
            return {"run": self.run_name, "state": self.state.value,
                    "step": self.history[-1]["step"] if self.history else 0,
                    "steps": self.cfg.train.steps,
                    "last": self.history[-1] if self.history else None,
                    "plan": self.plan.describe() if self.plan else None,
                    "workers": list(self.worker_info)}

    def stop(self) -> None:
        """Ask the loop to stop at the next step boundary."""
        self._stop.set()

    # -- the run ----------------------------------------------------------------
    def _transition(self, new: RunState, **detail) -> tuple[RunState, RunState]:
        with self._lock:
            prev, self.state = self.state, new
            self.events.append({"kind": "state", "from": prev.value, "to": new.value, "time": time.time(), **detail})
        return prev, new

    def run(self, return_model_state: bool = False) -> dict:
        try:
            self._transition(RunState.PLACING)
            self.plan = make_plan(self.cfg)
            self.placement = place_workers(self.cfg.scaling, self.plan.topology, f"{self.run_name}-pg")
            self.plan.rank_nodes = dict(self.placement.rank_node)
            self._transition(RunState.STARTING)
            self._start_workers()
            self._transition(RunState.RUNNING)
            self._loop()
            state = self._gather_state() if return_model_state else None
            self._transition(RunState.FINISHED)
            return {"history": self.history, "events": self.events, "plan": self.plan.describe(),
                    "workers": self.worker_info, "model_state": state}
        except BaseException as e:
            self._transition(RunState.FAILED, error=f"{type(e).__name__}: {e}")
            raise
        finally:
            self._teardown()

    def _start_workers(self) -> None:
        cfg, plan, pl = self.cfg, self.plan, self.placement
        res = dict(cfg.scaling.resources_per_worker)
        actor_cls = ray.remote(TrainWorker)
        self.workers = []
        for rank in range(plan.topology.world_size):
            replica, stage = plan.topology.coords(rank)
            opts = dict(
                name=f"{self.run_name}-rank{rank}-r{replica}s{stage}",
                num_cpus=res.get("CPU", 0), num_gpus=res.get("GPU", 0),
                resources={k: v for k, v in res.items() if k not in ("CPU", "GPU", "memory")} or None,
                max_concurrency=4, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pl.pg, placement_group_bundle_index=pl.rank_bundle[rank]),
            )
            if "memory" in res:
                opts["memory"] = res["memory"]
            self.workers.append(actor_cls.options(**opts).remote(self.run_name, rank, cfg.scaling.torch_threads))
        timeout = cfg.scaling.placement_timeout_s
        self.worker_info = self._get([w.info.remote() for w in self.workers], timeout, "start")
        master = self.worker_info[0]["ip"]
        port = self._get(self.workers[0].reserve_port.remote(), timeout, "reserve a port")
        setups = [w.setup.remote(self.cfg_json, plan.topology.dp, plan.topology.pp, plan.stage_bounds, master, port)
                  for w in self.workers]
        for info, s in zip(self.worker_info, self._get(setups, timeout + cfg.comm.timeout_s, "set up")):
            info.update(s)

    def _loop(self) -> None:
        cfg = self.cfg
        topo = self.plan.topology
        tokens = cfg.train.global_batch_size * cfg.data.seq_len
        step_timeout = cfg.comm.timeout_s + _STEP_SLACK_S
        for step in range(1, cfg.train.steps + 1):
            if self._stop.is_set():
                break
            t0 = time.perf_counter()
            outs = self._get([w.train_step.remote(step) for w in self.workers], step_timeout, f"run step {step}")
            dt = time.perf_counter() - t0
            losses = [o["loss"] for o in outs if o["loss"] is not None]
            record = {
                "step": step,
                "loss": sum(losses) / len(losses),
                "dp": topo.dp, "pp": topo.pp, "world_size": topo.world_size,
                "step_time_s": dt,
                "tokens_per_s": tokens / dt,
                "comm_s": max(o["comm_s"] for o in outs),
                # The slowest rank's own time; step_time_s minus this is what driving the step costs.
                # (Queuing the next step on the workers to hide that cost measured slower on
                # oversubscribed CPU nodes: Ray's task handling then competes with the step.)
                "worker_s": max(o["compute_s"] + o["comm_s"] for o in outs),
                "comm_bytes": sum(o["comm_bytes"] for o in outs),
                "time": time.time(),
            }
            with self._lock:
                self.history.append(record)

    def _gather_state(self) -> dict:
        """Full model state from replica 0's ranks (every replica holds the same weights)."""
        topo = self.plan.topology
        parts = self._get([self.workers[topo.rank(0, s)].state_dict.remote() for s in range(topo.pp)],
                          self.cfg.comm.timeout_s, "gather the model state")
        out = {}
        for p in parts:
            out.update(p)
        return out

    def _get(self, refs, timeout: float, what: str):
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(f"workers did not {what} within {timeout:g}s") from None
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None
        except ray.exceptions.RayActorError as e:
            raise WorkerError(f"a worker died while trying to {what}: {e}") from None

    def _teardown(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        self.workers = []
        if self.placement is not None:
            try:
                self.placement.remove()
            except Exception:
                pass

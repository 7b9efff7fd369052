"""A worker's fault hooks, for chaos tests and demos: only where ``failure.allow_fault_injection`` is set.

Set by ``TrainWorker.inject_fault`` or, from a worker's start, by environment
variables (``scaling.env_vars``), and read by the worker where each fault
applies: a step or evaluation that raises, a set-up, pin or snapshot that
holds, a compute that runs slower (a straggler), a worker that grows past its
memory limit (a memory kill).
"""

from __future__ import annotations

import os

from .integrity_faults import IntegrityFaults

# Seconds every snapshot holds its step, in all of a run's workers (set through scaling.env_vars).
SNAPSHOT_DELAY_ENV = "ELASTIC_TRAINER_SNAPSHOT_DELAY_S"
# Seconds a worker's first set-up holds (a start-up long enough for a chaos test to hit).
SETUP_DELAY_ENV = "ELASTIC_TRAINER_SETUP_DELAY_S"
# A chaos hook: raise inside the evaluation after this step (once per worker process).
EVAL_FAULT_ENV = "ELASTIC_TRAINER_EVAL_FAULT_STEP"
# A straggler hook: the worker that is this rank at its first set-up computes this many times
# slower from then on (worker.compute_clock), wherever later plans put it.
SLOW_RANK_ENV, SLOW_FACTOR_ENV = "ELASTIC_TRAINER_SLOW_RANK", "ELASTIC_TRAINER_SLOW_FACTOR"
# A memory-kill hook: the worker that is this rank at its first set-up grows past its cgroup's
# memory limit in this step (worker.memory_kills.grow_until_killed).
GROW_MEMORY_RANK_ENV, GROW_MEMORY_STEP_ENV = "ELASTIC_TRAINER_GROW_MEMORY_RANK", "ELASTIC_TRAINER_GROW_MEMORY_STEP"

KINDS = ("raise", "raise_eval", "slow_setup", "slow_pin", "slow_snapshot", "slow_compute", "grow_memory")


class FaultHooks:
    def __init__(self, allowed: bool, who: str, environ=None):
        env = os.environ if environ is None else environ
        self.allowed, self.who = allowed, who
        self._faults: dict = {}
        self.slow = 1.0            # compute slowdown factor (slow_compute)
        self._slow_steps: dict[int, float] = {}   # step -> its own factor (a one-step slow_compute)
        self._slow_rank = None     # (rank, factor) from the environment, until the first set-up
        self._grow_rank = None     # (rank, step) from the environment, until the first set-up
        # Faults that poison training (worker.integrity_faults); None where injection is off.
        self.integrity = IntegrityFaults(env) if allowed else None
        if not allowed:
            return
        if env.get(SNAPSHOT_DELAY_ENV):  # holds from the first step on
            self._faults["slow_snapshot"] = float(env[SNAPSHOT_DELAY_ENV])
        if env.get(SETUP_DELAY_ENV):
            self._faults["setup"] = float(env[SETUP_DELAY_ENV])
        if env.get(EVAL_FAULT_ENV):
            self._faults[("raise_eval", int(env[EVAL_FAULT_ENV]))] = True
        if env.get(SLOW_RANK_ENV):
            self._slow_rank = (int(env[SLOW_RANK_ENV]), float(env.get(SLOW_FACTOR_ENV, "2")))
        if env.get(GROW_MEMORY_RANK_ENV):
            self._grow_rank = (int(env[GROW_MEMORY_RANK_ENV]), int(env.get(GROW_MEMORY_STEP_ENV) or 0) or None)

    def check_allowed(self) -> None:
        if not self.allowed:
            raise PermissionError(f"fault injection is off in {self.who}: set failure.allow_fault_injection true "
                                  "in its config to inject faults")

    def inject(self, kind: str, step: int | None = None, seconds: float = 0.0) -> None:
        """See ``TrainWorker.inject_fault``."""
        self.check_allowed()
        if kind == "slow_snapshot":
            self._faults["slow_snapshot"] = seconds
        elif kind in ("raise", "raise_eval", "grow_memory"):
            self._faults[(kind, step)] = True
        elif kind == "slow_setup":
            self._faults["setup"] = seconds
        elif kind == "slow_pin":
            self._faults[("pin", step)] = seconds
        elif kind == "slow_compute":
            # ``seconds`` is the factor here: 3 makes this worker's compute take three times as long.
            # With a step, that step alone: a blip lands on the step meant, however late the
            # caller sees the run's steps.
            if step is None:
                self.slow = max(1.0, seconds)
            else:
                self._slow_steps[step] = max(1.0, seconds)
        else:
            raise ValueError(f"unknown fault kind {kind!r}; use {', '.join(KINDS)}")

    def injected(self, kind: str, step: int) -> bool:
        """Whether a fault of ``kind`` was injected for ``step`` (or for the next one); it is used up."""
        return bool(self._faults.pop((kind, step), None) or self._faults.pop((kind, None), None))

    def setup_delay(self) -> float:
        """Seconds the next set-up holds (used up)."""
        return self._faults.pop("setup", None) or 0.0

    def snapshot_delay(self) -> float:
        return self._faults.get("slow_snapshot") or 0.0

    def pin_delay(self, step: int) -> float:
        return self._faults.get(("pin", step), self._faults.get(("pin", None))) or 0.0

    def compute_factor(self, step: int) -> float:
        """The compute slowdown of ``step``: its own where one was injected for it (used up),
        else the standing one."""
        return self._slow_steps.pop(step, self.slow)

    def slow_factor(self, rank: int) -> float:
        """The compute slowdown of this worker, set up as ``rank``: the environment's slow rank is
        decided at the first set-up, and sticks to the worker (the memory grower likewise)."""
        if self._grow_rank is not None:
            if self._grow_rank[0] == rank:
                self._faults[("grow_memory", self._grow_rank[1])] = True
            self._grow_rank = None
        if self._slow_rank is not None:
            if self._slow_rank[0] == rank:
                self.slow = self._slow_rank[1]
            self._slow_rank = None
        return self.slow

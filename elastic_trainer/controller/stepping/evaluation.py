"""Validation during the run: the held-out loss every ``eval.every`` steps, on the current plan.

An evaluation is a call on every rank like a step, with the same timeouts and
the same failure handling: a rank lost during it starts a recovery, and the
evaluation of that step is run again once the run is back at it (after a
restore to that very step, or when the steps rolled back reach it again).
Its result goes on the step's history record (``eval_loss``), into the
metrics, and into the events (``eval``) the progress lines print.
"""

from __future__ import annotations

import time

from ...config import TrainerConfig
from ..run.run_record import RunRecord
from .one_step import StepDriver, StepOutcome
from ..run.workers import WorkerPool


class Evaluator:
    def __init__(self, cfg: TrainerConfig, run: RunRecord, pool: WorkerPool, driver: StepDriver):
        self.cfg, self.run, self.pool, self.driver = cfg, run, pool, driver
        self.ev = cfg.eval
        self.done: dict[int, float] = {}   # step -> eval loss, for steps not rolled back

    def due(self) -> bool:
        """Whether the evaluation after the last committed step is still to run."""
        return self.due_after(self.run.step)

    def due_after(self, step: int) -> bool:
        """Whether an evaluation is to run after ``step`` once it is committed (a lease issued
        ahead must not run past it)."""
        ev = self.ev
        if not ev.enabled or step == 0 or step in self.done:
            return False
        return step % ev.every == 0 or step == self.cfg.train.steps

    def run_after_step(self) -> StepOutcome:
        """Evaluate after the last committed step and record the result; the outcome, which the
        loop hands to recovery when it failed (``due`` then stays true)."""
        run = self.run
        step = run.step
        out = self.driver.evaluate(step, {w: self.pool[w].actor for w in run.ranks.values()}, self.ev.batches)
        if not out.ok:
            return out
        losses = [o["loss"] for o in out.results.values() if o["loss"] is not None]
        # Every replica's last stage evaluates an equal share of the same windows.
        loss = sum(losses) / len(losses)
        self.done[step] = loss
        run.record_eval(step, loss, time.perf_counter() - out.started)
        return out

    def rolled_back(self, restored: int) -> None:
        """Steps after ``restored`` will run again, and so will their evaluations."""
        self.done = {s: v for s, v in self.done.items() if s <= restored}

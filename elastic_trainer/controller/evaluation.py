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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .controller import Controller


class Evaluator:
    def __init__(self, ctl: "Controller"):
        self.ctl = ctl
        self.ev = ctl.cfg.eval
        self.done: dict[int, float] = {}   # step -> eval loss, for steps not rolled back

    def due(self) -> bool:
        """Whether the evaluation after the last committed step is still to run."""
        return self.due_after(self.ctl.step)

    def due_after(self, step: int) -> bool:
        """Whether an evaluation is to run after ``step`` once it is committed (a lease issued
        ahead must not run past it)."""
        ev = self.ev
        if not ev.enabled or step == 0 or step in self.done:
            return False
        return step % ev.every == 0 or step == self.ctl.cfg.train.steps

    def run(self) -> None:
        """Evaluate after the last committed step; a failure goes to recovery, and ``due`` stays true."""
        ctl = self.ctl
        step = ctl.step
        out = ctl.driver.evaluate(step, {w: ctl.pool[w].actor for w in ctl.ranks.values()}, self.ev.batches)
        if not out.ok:
            ctl.recovery.recover(out)
            return
        losses = [o["loss"] for o in out.results.values() if o["loss"] is not None]
        # Every replica's last stage evaluates an equal share of the same windows.
        loss = sum(losses) / len(losses)
        seconds = time.perf_counter() - out.started
        self.done[step] = loss
        with ctl._lock:
            for rec in reversed(ctl.history):
                if rec["step"] == step:
                    rec["eval_loss"] = loss
                    rec["eval_s"] = seconds
                    break
        ctl.metrics.record_step({"eval_loss": loss})
        topo = ctl.plan.topology
        ctl.event("eval", step=step, loss=loss, seconds=seconds, dp=topo.dp, pp=topo.pp)

    def rolled_back(self, restored: int) -> None:
        """Steps after ``restored`` will run again, and so will their evaluations."""
        self.done = {s: v for s, v in self.done.items() if s <= restored}

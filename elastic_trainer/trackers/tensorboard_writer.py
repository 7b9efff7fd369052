"""TensorBoard: a run's scalars, events and config in one event-file directory.

Written with ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package), whose
writes go to a queue its own thread drains, so a step costs the driver no disk wait.

A rollback re-sends steps already written. TensorBoard's reader keeps, for each tag, the
latest value written at a step (a value at step s preempts those at s and later), so the
curves show the steps that count. Event texts are written under one tag per kind at strictly
increasing steps (the event's step, or one past the kind's last), so a later event of the same
kind at a rolled-back step never preempts an earlier one; the text names the event's own step.
"""

from __future__ import annotations

import os

from ..config import TrainerConfig
from .records import COUNTED, EventWords, event_detail, flat_config, goodput_scalars, step_scalars

# hparams values are shown in a table: long ones are cut.
_HPARAM_LIMIT = 500


def log_dir(cfg: TrainerConfig, run_name: str) -> str:
    """``<run.tensorboard_dir>/<run>``, by default ``<report_dir>/tensorboard/<run>``."""
    base = cfg.run.tensorboard_dir or os.path.join(cfg.run.report_dir or "elastic_trainer_reports", "tensorboard")
    return os.path.abspath(os.path.join(os.path.expanduser(base), run_name))


class TensorBoardTracker:
    """Writes one run to ``log_dir(cfg, run_name)``."""

    name = "tensorboard"

    def __init__(self, cfg: TrainerConfig, run_name: str):
        from torch.utils.tensorboard import SummaryWriter

        self.path = log_dir(cfg, run_name)
        self.where = f"tensorboard: {self.path}"
        self._writer = SummaryWriter(self.path)
        self._words = EventWords(cfg)
        self._last_step = 0                         # the newest step seen: where a step-less event goes
        self._event_steps: dict[str, int] = {}      # kind -> the step its last text was written at
        self._counts: dict[str, int] = {}
        self._config(cfg, run_name)

    def _config(self, cfg: TrainerConfig, run_name: str) -> None:
        from torch.utils.tensorboard.summary import hparams

        flat = flat_config(cfg.model_dump(mode="json"), _HPARAM_LIMIT)
        self._writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in flat.items()), 0)
        # hparams() only names the metrics the HParams tab plots against the parameters.
        for summary in hparams(flat, {"train/loss": None, "throughput/tokens_per_s": None},
                               hparam_domain_discrete=None):
            self._writer.file_writer.add_summary(summary)
        self._writer.add_text("run", run_name, 0)

    def step(self, rec: dict) -> None:
        s = int(rec["step"])
        when = rec.get("time")
        for tag, value in step_scalars(rec).items():
            self._writer.add_scalar(tag, value, s, walltime=when)
        self._last_step = max(self._last_step, s)

    def event(self, ev: dict) -> None:
        kind = str(ev.get("kind", "event"))
        own = ev.get("step")
        at = max(int(own) if isinstance(own, int) else self._last_step, self._event_steps.get(kind, -1) + 1)
        self._event_steps[kind] = at
        when = ev.get("time")
        head = f"{kind} at step {own}: " if own is not None else f"{kind}: "
        self._writer.add_text(f"events/{kind}", f"{head}{self._words.line(ev)}\n\n    {event_detail(ev)}", at,
                              walltime=when)
        if kind == "eval" and isinstance(ev.get("loss"), (int, float)) and isinstance(own, int):
            self._writer.add_scalar("train/eval_loss", float(ev["loss"]), own, walltime=when)
        if kind in COUNTED:
            self._counts[kind] = self._counts.get(kind, 0) + 1
            self._writer.add_scalar(f"events/{kind}", self._counts[kind], at, walltime=when)

    def flush(self) -> None:
        self._writer.flush()

    def close(self, state: str, goodput: dict | None) -> None:
        self._writer.add_text("state", state, self._last_step)
        for tag, value in goodput_scalars(goodput).items():
            self._writer.add_scalar(tag, value, self._last_step)
        self._writer.close()

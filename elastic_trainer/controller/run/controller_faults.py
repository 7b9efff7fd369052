"""The controller's own chaos hooks (only with ``failure.allow_fault_injection``): a durable write
held, an error raised in the loop, and a fault campaign's hold on the run's named points."""

from __future__ import annotations

from ...config import TrainerConfig
from .run_record import RunRecord


class ControllerFaults:
    """``inject`` and ``point`` for one call; ``writer``: the run's durable writer, if any."""

    def __init__(self, cfg: TrainerConfig, run_name: str, record: RunRecord, writer):
        self.cfg, self.run_name, self.record, self.writer = cfg, run_name, record, writer

    def inject(self, kind: str, seconds: float = 0.0, step: int | None = None) -> None:
        """``slow_durable`` holds each durable write ``seconds`` before it fetches its parts (0
        ends it); ``controller_error`` raises an unexpected error in the loop before ``step``
        (without one: before the next)."""
        if not self.cfg.failure.allow_fault_injection:
            raise PermissionError(f"fault injection is off in run {self.run_name!r}: set "
                                  "failure.allow_fault_injection true in its config to inject faults")
        if kind == "controller_error":
            self.record.error_at = step or 0   # 0: the next step
            return
        if kind != "slow_durable":
            raise ValueError(f"unknown controller fault kind {kind!r}; use slow_durable or controller_error")
        if self.writer is None:
            raise ValueError("slow_durable needs checkpoint.storage: this run writes no durable checkpoints")
        self.writer.delay_s = seconds

    def point(self, op: str, point: str | None = None, occurrence: int = 1):
        """``arm`` ``point`` at its ``occurrence``-th pass from now, see what is ``held``,
        ``release`` it, or its ``state`` (``fault_points``)."""
        if not self.cfg.failure.allow_fault_injection:
            raise PermissionError(f"fault points are for fault injection, which is off in run {self.run_name!r}: "
                                  "set failure.allow_fault_injection true in its config")
        points = self.record.points
        if op == "arm":
            return points.arm(point, occurrence)
        if op in ("held", "release", "state"):
            return getattr(points, op)()
        raise ValueError(f"unknown fault point op {op!r}; use arm, held, release or state")

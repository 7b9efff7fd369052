"""What failures a run has left: the count held to ``failure.max_failures``, and the retries of a
collective that failed while every worker lived (``failure.retries``, back at every step).

Past its limits a run stops with ``errors.RunError``, after the newest committed snapshot is
saved where the run keeps durable checkpoints (``give_up``).
"""

from __future__ import annotations

from typing import Callable, NoReturn

from ...config import TrainerConfig
from ...errors import RunError


class FailureBudget:
    def __init__(self, cfg: TrainerConfig, emergency: Callable[[str], str | None]):
        self._cfg = cfg.failure
        self._emergency = emergency   # saves the newest committed snapshot on the way out; its path
        self.failures = 0
        self.retries_left = self._cfg.retries

    def count(self, retryable: bool = False) -> None:
        """One more failure; ``retryable`` (a collective failed with every worker alive) spends a
        retry first, and counts only when the retries are spent."""
        if retryable and self.retries_left > 0:
            self.retries_left -= 1
        else:
            self.failures += 1

    def check(self, kind: str, detail: str) -> None:
        """Raises ``RunError`` once the failures pass ``failure.max_failures``; ``kind`` and
        ``detail`` name the last one."""
        if self.failures > self._cfg.max_failures:
            self.give_up(f"stopped after {self.failures} failures (failure.max_failures="
                         f"{self._cfg.max_failures}); last: {kind}: {detail}")

    def give_up(self, message: str) -> NoReturn:
        """Save the newest committed snapshot durably (where there is storage), then raise
        ``RunError(message)`` naming where it went."""
        path = self._emergency("the run is stopping after failures")
        raise RunError(message + (f"; durable checkpoint at {path}" if path else ""))

    def step_committed(self) -> None:
        """A step completed on every rank: its retries are back."""
        self.retries_left = self._cfg.retries

"""A training run on the lab, driven from its head host (``lab.driver``) and watched from outside
by its progress file: what a test or benchmark times its faults on."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .hosts import Lab


class LabRun:
    """A training run driven from the lab's head host (``lab.driver``), watched from outside."""

    def __init__(self, lab: Lab, config: dict, out: Path):
        self.lab, self.out = lab, out
        self.proc = lab.run_driver(config, out)

    def lines(self) -> list[dict]:
        f = self.out / "progress.jsonl"
        if not f.exists():
            return []
        return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]

    def await_step(self, step: int, timeout_s: float = 120) -> dict:
        """Wait until the run has done ``step``; rank -> host address of its plan then."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lines = self.lines()
            if lines and lines[-1]["step"] >= step:
                return {int(r): a for r, a in next(x["ranks"] for x in reversed(lines) if "ranks" in x).items()}
            if self.proc.poll() is not None:
                raise AssertionError(f"the driver ended before step {step}: {self.result()}")
            time.sleep(0.05)
        raise AssertionError(f"step {step} not reached in {timeout_s:g} s; progress {self.lines()[-3:]}")

    def plan(self) -> int | None:
        """The index of the plan the last step seen ran on."""
        lines = self.lines()
        return lines[-1]["plan"] if lines else None

    def await_new_plan(self, than: int, timeout_s: float = 60) -> dict:
        """Wait until the run steps on a plan other than ``than``; that plan's rank -> host address."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lines = self.lines()
            if lines and lines[-1]["plan"] != than:
                return {int(r): a for r, a in next(x["ranks"] for x in reversed(lines) if "ranks" in x).items()}
            if self.proc.poll() is not None:
                raise AssertionError(f"the driver ended before a re-plan: {self.result()}")
            time.sleep(0.05)
        raise AssertionError(f"no new plan in {timeout_s:g} s; progress {self.lines()[-3:]}")

    def result(self, timeout_s: float = 180) -> dict:
        self.proc.wait(timeout=timeout_s)
        f = self.out / "result.json"
        if not f.exists():
            log = self.lab.head.dir / "driver.log"
            raise AssertionError(f"no result; the driver's log ends: {log.read_text()[-3000:] if log.exists() else ''}")
        return json.loads(f.read_text())

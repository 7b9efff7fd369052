"""``<run.report_dir>/<run>.ranks.jsonl``: each step's per-rank figures, one JSON line a step.

The driver appends what the controller hands it (``controller/run/rank_figures.py``) as
the run goes, so neither the step records nor the driver's memory grow with the
number of ranks. A step run again after a rollback has a line each time; readers
keep the last. The report's pace strip reads it back at most ``max_steps`` steps
wide, whatever the run's length.
"""

from __future__ import annotations

import json
import os


def ranks_path(report_dir: str, run_name: str) -> str:
    return os.path.join(os.path.expanduser(report_dir), f"{run_name}.ranks.jsonl")


class RankFile:
    """Appends per-rank figures to ``path`` (made anew for each run)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self._f = open(path, "w", encoding="utf-8")   # noqa: SIM115 - held for the run, closed in close()
        self.dropped = 0   # steps the controller let go before the driver asked for them

    def write(self, figures: list[dict], dropped: int = 0) -> None:
        self.dropped += dropped
        for fig in figures:
            self._f.write(json.dumps(fig, separators=(",", ":")) + "\n")
        if figures:
            self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_rank_figures(path: str, max_steps: int = 2000) -> list[dict]:
    """The figures of ``path`` in step order, the last line of each step, thinned to at most
    ``max_steps`` evenly spaced steps; [] where there is no file."""
    if not os.path.exists(path):
        return []
    by_step: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                fig = json.loads(line)
                by_step[fig["step"]] = fig
    steps = sorted(by_step)
    stride = max(1, -(-len(steps) // max_steps))
    return [by_step[s] for s in steps[::stride]]

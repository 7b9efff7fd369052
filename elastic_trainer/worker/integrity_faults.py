"""Faults that poison training rather than end it, for tests and demos of ``integrity``: only where
``failure.allow_fault_injection`` is set.

- ``nan``: one micro-batch's loss of the rank that is ``rank`` at ``step`` becomes NaN (once);
- ``poison``: the targets of every batch read from the samples of steps ``steps = [a, b]`` (as the
  order stood before any skip: samples ``[(a-1)B, bB)``) are replaced by random tokens, a loss
  spike from a poisoned data window;
- ``flip``: one bit (``bit``, default 20) of one element (``index``, default 0) of the rank's
  ``gradient`` of ``name`` (default: its first parameter) after its replica's average, of the
  ``parameter`` as step ``step``'s update wrote it, or of the ``optimizer`` state (``state``,
  default ``exp_avg``) as held when step ``step`` begins: silent data corruption in compute and
  at rest.

Given by ``TrainWorker.inject_fault`` or, from the start, as a JSON list in the environment
variable ``ELASTIC_TRAINER_INTEGRITY_FAULTS`` (``scaling.env_vars``), e.g.
``[{"kind": "nan", "step": 20, "rank": 3}]``. A fault of a rank belongs to the worker that is that
rank when the run starts (``bind``), wherever later plans put it, as a faulty device's would: a
replacement that takes the rank over later, reading the same environment, does not inherit it.
"""

from __future__ import annotations

import json
import os

ENV = "ELASTIC_TRAINER_INTEGRITY_FAULTS"
KINDS = ("nan", "poison", "flip")
WHERE = ("gradient", "parameter", "optimizer")


class IntegrityFaults:
    def __init__(self, environ=None):
        env = os.environ if environ is None else environ
        self.specs: list[dict] = []
        self._bound = False
        for spec in json.loads(env.get(ENV) or "[]"):
            self.add(spec)

    def bind(self, rank: int, at_start: bool) -> None:
        """At this worker's first set-up (as ``rank``; ``at_start``: the run's start, from the
        seed): the environment's faults of ``rank`` become this worker's (``rank`` None), those of
        other ranks go; a worker that joins a run under way keeps none but its data's (poison)."""
        if self._bound:
            return
        self._bound = True
        kept = []
        for spec in self.specs:
            if spec["kind"] == "poison":
                kept.append(spec)
            elif at_start and spec.get("rank") == rank:
                kept.append({**spec, "rank": None})
        self.specs = kept

    def add(self, spec: dict) -> None:
        kind = spec.get("kind")
        if kind not in KINDS:
            raise ValueError(f"unknown integrity fault {kind!r}; use {', '.join(KINDS)}")
        if kind == "poison":
            a, b = spec.get("steps") or (None, None)
            if a is None or b is None or not 1 <= a <= b:
                raise ValueError(f"a poison fault names its steps as [first, last], got {spec.get('steps')}")
        elif spec.get("step") is None or ("rank" not in spec and not self._bound):
            raise ValueError(f"a {kind} fault names its step and rank, got {spec}")
        if kind == "flip" and spec.get("where", "parameter") not in WHERE:
            raise ValueError(f"a flip goes into one of {', '.join(WHERE)}, got {spec.get('where')!r}")
        self.specs.append(dict(spec))

    def _take(self, kind: str, step: int, rank: int) -> dict | None:
        for spec in self.specs:
            if spec["kind"] == kind and spec["step"] == step and spec.get("rank") in (None, rank):
                self.specs.remove(spec)
                return spec
        return None

    def nan_micro(self, step: int, rank: int) -> int | None:
        """The micro-batch whose loss turns NaN in this attempt at ``step`` (used up), or None."""
        spec = self._take("nan", step, rank)
        return None if spec is None else int(spec.get("micro_batch", 0))

    def poisoned(self, cursor: int, global_batch: int) -> bool:
        """Whether the batch starting at sample ``cursor`` is in a poisoned window."""
        return any(s["kind"] == "poison" and (s["steps"][0] - 1) * global_batch <= cursor < s["steps"][1] * global_batch
                   for s in self.specs)

    def flip(self, step: int, rank: int, where: str) -> dict | None:
        """The flip into ``where`` at ``step`` on ``rank`` (used up), or None."""
        for spec in self.specs:
            if (spec["kind"] == "flip" and spec["step"] == step and spec.get("rank") in (None, rank)
                    and spec.get("where", "parameter") == where):
                self.specs.remove(spec)
                return spec
        return None

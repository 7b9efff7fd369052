"""Fault schedules: which faults, on which rank, at which named point of the run, from a seed.

A fault's moment is a point of the run's own phases (``controller.run.fault_points.POINTS``)
and which time the run passes it, counted from when the fault before it struck (the first
fault's from the start): ``("restore", 1)`` after a kill is that kill's own recovery. A
schedule is a list of faults and prints as one line of JSON, which ``--replay`` takes back.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field

from ...controller.run.fault_points import POINTS

# What the simulated cluster can do to a run; the lab adds a cut link and a memory kill. A
# drain is a preemption notice for the node of a rank (Ray's GCS ``DrainNode``), the node
# removed at its deadline: ``drain`` with room to move (``seconds`` of notice), ``short_drain``
# with too little, which takes the loss path at the deadline.
KINDS = ("kill_process", "kill_node", "freeze", "join", "storage_outage", "drain", "short_drain")
LAB_KINDS = ("cut", "memory_kill")
DRAINS = ("drain", "short_drain")
# Faults that take a worker away (at once, or until it comes back): a failure without one is a
# false alarm. A kill must be seen (a failure, a fence, or a worker named gone at the end); a
# freeze or a cut thawed before anyone waited on the worker may pass unseen, and so may a short
# drain whose deadline comes after the run ended. A drain with room to move is no failure at all.
LETHAL = ("kill_process", "kill_node", "freeze", "cut", "memory_kill", "short_drain")
KILLS = ("kill_process", "kill_node", "memory_kill")

# Points every run passes, with the occurrences a draw picks from (a run of ``steps`` steps,
# a snapshot every step, a durable write every ``durable_every``); the rest need a fault first.
_ALWAYS = ("in_step", "between_steps", "snapshot_in_flight", "setup", "durable_write", "final_save")
# A grow comes once a lost worker's place is taken again: a new worker on the free node (a killed
# process's, or a spare's); the runner slows the steps until it has joined (``runner``). Not after
# a memory kill: the run starts nothing on that host again (``controller.failures.memory_kills``).
_AFTER = {"restore": ("kill_process", "kill_node", "freeze", "cut", "memory_kill", "short_drain"),
          "grow_ordered": ("kill_process", "kill_node"), "fenced": ("freeze", "cut")}


VARIANTS = ("whole", "sharded")
# A notice that comes while the run recovers from a loss or grows: covered by the CI's few schedules.
_DRAIN_DURING = ("restore", "grow_ordered")


def variant(seed: int | None) -> str:
    """Which optimizer-state layout a schedule's run uses: every third seed shards it (ZeRO-2),
    so the sharded paths (slices, their snapshots and checkpoints) meet the faults too."""
    return "sharded" if seed is not None and seed % 3 == 2 else "whole"


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` at the ``occurrence``-th pass of ``point``, on the worker of ``rank``
    (lethal kinds), lasting ``seconds`` (freeze, storage outage, cut: then it is undone)."""

    kind: str
    point: str
    occurrence: int = 1
    rank: int = 0
    seconds: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS + LAB_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; kinds: {', '.join(KINDS + LAB_KINDS)}")
        if self.point not in POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; points: {', '.join(POINTS)}")

    def line(self) -> str:
        what = f"{self.kind}(rank {self.rank})" if self.kind in LETHAL + DRAINS else self.kind
        return f"{what} at {self.point}#{self.occurrence}" + (f" for {self.seconds:g}s" if self.seconds else "")


@dataclass
class Schedule:
    """The faults of one run, in order, and the seed they were drawn from (None: written by hand)."""

    faults: list[Fault] = field(default_factory=list)
    seed: int | None = None

    def to_json(self) -> str:
        return json.dumps({"seed": self.seed, "faults": [asdict(f) for f in self.faults]}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        try:
            raw = json.loads(text)
            return cls([Fault(**f) for f in raw["faults"]], raw.get("seed"))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not a fault schedule ({type(e).__name__}: {e}): {text[:200]!r}; expected "
                             '{"seed": N, "faults": [{"kind": ..., "point": ..., "occurrence": N, "rank": N}]}') \
                from None

    def describe(self) -> str:
        return "; ".join(f.line() for f in self.faults) or "no fault"


def draw(seed: int, steps: int, world: int, durable_every: int, lab: bool = False, max_faults: int = 2) -> Schedule:
    """The schedule of ``seed`` for a run of ``steps`` steps on ``world`` ranks: one to
    ``max_faults`` faults, the second often inside the first's recovery (at its set-up or
    restore) or while its worker is fenced; a join's grow may be struck as it is ordered."""
    rng = random.Random(seed)
    kinds = KINDS + (LAB_KINDS if lab else ())
    faults: list[Fault] = []
    for i in range(rng.randint(1, max_faults)):
        kind = rng.choice(kinds)
        # What the fault before leaves to strike in: a recovery's restore, a fenced worker, a grow.
        # None after a fault at the start-up's set-up (its re-plan starts from the seed, no restore).
        after = faults[-1].kind if faults and (faults[-1].point, faults[-1].occurrence) != ("setup", 1) else None
        points = list(_ALWAYS) + [p for p, needs in _AFTER.items() if after in needs]
        if i and after:
            # A second fault lands in the first's aftermath more often than not.
            points += [p for p, needs in _AFTER.items() if after in needs] * 3
        if i and "final_save" in [f.point for f in faults]:
            break   # nothing comes after the final save
        point = rng.choice(points)
        faults.append(Fault(kind, point, _occurrence(rng, point, steps, durable_every, first=not faults),
                            rng.randrange(world), _seconds(rng, kind)))
        if point == "final_save":
            break
    return Schedule(faults, seed)


def _occurrence(rng: random.Random, point: str, steps: int, durable_every: int, first: bool) -> int:
    if point in ("in_step", "between_steps", "snapshot_in_flight"):
        return rng.randint(2, max(2, steps // 2)) if first else rng.randint(1, 4)
    if point == "durable_write":
        return rng.randint(1, max(1, steps // durable_every - 1))
    if point == "setup":
        return 1 if first else rng.randint(1, 2)
    return 1


def _seconds(rng: random.Random, kind: str) -> float:
    if kind == "freeze":
        return round(rng.uniform(2.0, 5.0), 1)
    if kind in ("storage_outage", "cut"):
        return round(rng.uniform(1.0, 3.0), 1)
    if kind == "drain":
        # Seconds of notice: the drains' check (2 s), a step, a re-plan and the tiny state's move
        # fit several times over.
        return round(rng.uniform(8.0, 15.0), 1)
    if kind == "short_drain":
        return round(rng.uniform(0.5, 2.5), 1)
    return 0.0


def covering(steps: int, world: int, durable_every: int, lab: bool = False, start: int = 0,
             limit: int = 800) -> list[Schedule]:
    """Few schedules that together cover every fault kind, every point, a drain during a
    recovery and during a grow, and both optimizer-state layouts (``variant``) at least once: of the
    seeds ``start`` to ``start + limit``, each time the one that adds the most not yet covered
    (the lowest seed among equals). The short campaign CI runs."""
    kinds = set(KINDS + (LAB_KINDS if lab else ()))
    want = ({("kind", k) for k in kinds} | {("point", p) for p in POINTS} | {("variant", v) for v in VARIANTS}
            | {("drain during", p) for p in _DRAIN_DURING})
    pool = [draw(seed, steps, world, durable_every, lab) for seed in range(start, start + limit)]
    covers = [{("kind", f.kind) for f in s.faults} | {("point", f.point) for f in s.faults}
              | {("drain during", f.point) for f in s.faults if f.kind in DRAINS and f.point in _DRAIN_DURING}
              | {("variant", variant(s.seed))} for s in pool]
    out: list[Schedule] = []
    while want:
        best = max(range(len(pool)), key=lambda i: (len(covers[i] & want), -i))
        if not covers[best] & want:
            raise ValueError(f"no seed of {start}..{start + limit - 1} covers {sorted(want)}")
        out.append(pool[best])
        want -= covers[best]
    return sorted(out, key=lambda s: s.seed)

"""What a run hands back: typed step records, events by kind, the checkpoint it left, and the
``Result`` that holds them.

Records and events are dataclasses with named fields that still read as mappings
(``rec["loss"]``, ``dict(rec)``, ``ev.get("step")``), so code written against the dicts of
earlier versions keeps working; ``History`` and ``Events`` turn into plain dicts, a pandas
DataFrame or a pyarrow Table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator


class _Fields(Mapping):
    """A dataclass read as a mapping: the keys it was made from (``from_dict``; all its fields
    where made directly), ``extra`` flattened in. A field the source dict lacked is None as an
    attribute and absent as a key, so ``rec.get(k, default)`` and ``k in rec`` read as before."""

    def _keys(self) -> list[str]:
        given = self.__dict__.get("_given")
        fields = [f.name for f in dataclasses.fields(self) if f.name != "extra"]
        return [n for n in fields if given is None or n in given] + list(self.extra)

    def to_dict(self) -> dict:
        return {k: self[k] for k in self._keys()}

    def __getitem__(self, key: str):
        if key != "extra" and key in self._names():
            given = self.__dict__.get("_given")
            if given is not None and key not in given:
                raise KeyError(key)
            return getattr(self, key)
        return self.extra[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    @classmethod
    def _names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, d: Mapping):
        names = cls._names() - {"extra"}
        obj = cls(**{k: v for k, v in d.items() if k in names}, extra={k: v for k, v in d.items() if k not in names})
        obj.__dict__["_given"] = frozenset(d)
        return obj


@dataclass(eq=False)
class StepRecord(_Fields):
    """One step as the run completed it. ``time`` is when (epoch seconds); ``plan`` indexes
    ``Result.plans``; times are seconds; anything a newer controller adds is in ``extra``."""

    step: int
    loss: float | None = None
    lr: float | None = None
    dp: int | None = None
    pp: int | None = None
    world_size: int | None = None
    plan: int | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    comm_time_s: float | None = None
    exposed_comm_s: float | None = None
    comm_bytes: int | None = None
    compression_ratio: float | None = None
    loss_scale: float | None = None
    skipped: bool | None = None
    grad_norm: float | None = None   # the global gradient norm before clipping, agreed over every rank
    snapshot: Any = None
    cursor: int | None = None
    time: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def comm_share(self) -> float | None:
        """The share of the step's time spent waiting on communication (exposed, not overlapped)."""
        if self.exposed_comm_s is None or not self.step_time_s:
            return None
        return min(1.0, self.exposed_comm_s / self.step_time_s)


@dataclass(eq=False)
class Event(_Fields):
    """Something that happened to the run: ``kind`` (``state``, ``failure``, ``recovery``,
    ``replan``, ``durable_checkpoint``, ``drain``, ...) at ``time`` (epoch seconds), with the
    kind's own fields in ``extra`` (read them as ``ev["reason"]`` or ``ev.get("step")``)."""

    kind: str
    time: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def step(self) -> int | None:
        """The step the event names, where it names one."""
        return self.extra.get("step")


def _table(rows: list[dict]) -> dict[str, list]:
    cols: dict[str, list] = {}
    for i, row in enumerate(rows):
        for k in row:
            cols.setdefault(k, [None] * i)
        for k, col in cols.items():
            v = row.get(k)
            # Nested values (a snapshot's detail, a plan) go to a table as text.
            col.append(v if v is None or isinstance(v, (int, float, str, bool)) else repr(v))
    return cols


class _Rows(list):
    def to_dicts(self) -> list[dict]:
        """Plain dicts, one per row (JSON-ready where the values are)."""
        return [r.to_dict() for r in self]

    def to_pandas(self):
        """A pandas DataFrame, a column per field (nested values as text); needs pandas installed."""
        import pandas as pd

        return pd.DataFrame(_table(self.to_dicts()))

    def to_arrow(self):
        """A pyarrow Table, a column per field (nested values as text)."""
        import pyarrow as pa

        return pa.table(_table(self.to_dicts()))


class History(_Rows):
    """The run's steps, one ``StepRecord`` each, in order (a rollback's redone steps once)."""

    @classmethod
    def of(cls, rows) -> "History":
        return cls(r if isinstance(r, StepRecord) else StepRecord.from_dict(r) for r in rows)


class Events(_Rows):
    """The run's events, one ``Event`` each, in order; ``of(kind)`` picks one kind."""

    @classmethod
    def of_dicts(cls, rows) -> "Events":
        return cls(r if isinstance(r, Event) else Event.from_dict(r) for r in rows)

    def of(self, *kinds: str) -> "Events":
        """The events of these kinds, in order."""
        return Events(e for e in self if e.kind in kinds)

    @property
    def kinds(self) -> list[str]:
        """The kinds that occurred, in the order each first did."""
        return list(dict.fromkeys(e.kind for e in self))


@dataclass(frozen=True)
class Checkpoint:
    """What a run left to continue or use from: ``path`` the final durable checkpoint
    (``fit(resume=path)`` continues from it; None without ``checkpoint.storage``), ``weights``
    the final weights (model.safetensors), ``hf`` a Hugging Face folder (model.kind hf),
    ``step`` the step they hold."""

    step: int | None
    path: str | None = None
    weights: str | None = None
    hf: str | None = None
    run_id: str | None = None


@dataclass
class Result:
    """What a run produced."""

    run_name: str
    history: History             # one StepRecord per step
    events: Events               # state transitions, failures, recoveries, checkpoints, with times
    plan: dict                   # topology, stage cut and node of every rank
    workers: list[dict] = field(default_factory=list)
    plans: list[dict] = field(default_factory=list)  # every plan the run used; a record's ``plan`` indexes it
    model_state: dict[str, Any] | None = None  # global parameter name -> tensor, when asked for
    report_path: str | None = None  # the run report PNG, if written
    model_path: str | None = None   # the final weights (model.safetensors), written and read back
    durable_path: str | None = None  # the final durable checkpoint, where checkpoint.storage is set
    hf_path: str | None = None       # model.kind hf: a folder AutoModelForCausalLM.from_pretrained loads
    run_id: str | None = None        # the id its durable checkpoints carry
    # FINISHED: every step run; STOPPED: ended early by a stop, saved; ABORTED: ended at once
    # (``Run.stop(save=False)``, a second Ctrl-C), only what was already durable is kept.
    state: str = "FINISHED"
    step: int | None = None          # the last step run, which the weights (and durable_path) hold
    ranks_path: str | None = None    # each step's per-rank compute, wait and pace (JSON lines), with report_dir
    # Where the wall time went: {"wall_s", "effective_s", "goodput", "seconds": bucket -> s}
    # (controller.run.goodput.BUCKETS; the buckets add up to wall_s).
    goodput: dict | None = None

    def __post_init__(self):
        self.history = History.of(self.history)
        self.events = Events.of_dicts(self.events)

    @property
    def checkpoint(self) -> Checkpoint:
        """The durable checkpoint and the weights the run left, and their step."""
        return Checkpoint(step=self.step, path=self.durable_path, weights=self.model_path, hf=self.hf_path,
                          run_id=self.run_id)

    @property
    def finished(self) -> bool:
        """Every step was run (a failed run raises instead of returning)."""
        return self.state == "FINISHED"

    @property
    def stopped(self) -> bool:
        """A stop ended the run before its last step, at ``step``; what it had is saved."""
        return self.state == "STOPPED"

    @property
    def aborted(self) -> bool:
        """The run was ended at once, without a save: ``durable_path`` is the newest durable
        checkpoint it had written before (None if none)."""
        return self.state == "ABORTED"

    @property
    def failures(self) -> Events:
        return self.events.of("failure")

    @property
    def recoveries(self) -> Events:
        return self.events.of("recovery")

    @property
    def anomalies(self) -> Events:
        """Steps judged non-finite or spiking, applied nowhere (``integrity.on_anomaly``)."""
        return self.events.of("anomaly")

    @property
    def corruptions(self) -> Events:
        """Replicas found disagreeing: who was proven at fault, and the nodes quarantined."""
        return self.events.of("corruption")

    @property
    def final_loss(self) -> float | None:
        return self.history[-1].loss if self.history else None

"""Whether a durable checkpoint may be resumed by a run's config.

Everything that decides what is trained must match: the model, the data and its sample order,
the seed, the global batch, the optimizer and its hyper-parameters, the precision, the
gradient exchange, the schedule. What only lays the run out or operates it may change
(dp, pp, placement, micro-batches, checkpointing, failure handling, ...). A few changes of
the schedule are safe when the user asks for them by name (``ACCEPTABLE``): more steps, a new
learning rate or schedule."""

from __future__ import annotations

import os
from typing import Any, Iterable

from ..errors import ConfigError
from ..storage.credentials import take_credentials

# Sections that say how a run is laid out and operated, not what it trains.
_FREE_SECTIONS = ("run", "parallel", "scaling", "checkpoint", "failure", "control", "balance")
# Keys elsewhere that leave the arithmetic and the sample order as they are: a global batch
# cut into other micro-batches, recomputed activations, where evaluation reads, how the
# gradient buckets travel (the order of a sum, as a new dp also changes).
_FREE_KEYS = frozenset({
    "train.micro_batch_size", "train.activation_checkpointing", "data.prepare", "data.read_ahead_mb",
    "eval.path", "eval.every", "eval.batches", "comm.bucket_mb", "comm.timeout_s", "comm.overlap",
    "comm.algorithm", "comm.constants"})
# Changes a resume takes when named (--accept-change): the same optimisation, scheduled anew.
ACCEPTABLE = ("train.steps", "train.lr", "train.lr_schedule", "train.warmup_steps", "train.min_lr")


def _flat(cfg: dict) -> dict[str, Any]:
    """``section.key -> value`` of a config dict (nested values such as model.kwargs whole)."""
    return {f"{section}.{k}": v for section, keys in (cfg or {}).items() if isinstance(keys, dict)
            for k, v in keys.items()}


def _changes(stored_cfg: dict, cfg: dict, stored_data: dict | None, data: dict | None) -> list[tuple[str, Any, Any]]:
    """``(field, checkpoint's value, this run's)`` of every field that differs and is not free.
    A stored config or fingerprint that lacks a field (an older checkpoint) is not held against it."""
    want, have = _flat(stored_cfg), _flat(cfg)
    out = [(k, want[k], have.get(k)) for k in want
           if k.split(".")[0] not in _FREE_SECTIONS and k not in _FREE_KEYS and want[k] != have.get(k)]
    if stored_data and data:
        out += [(f"data ({k})", stored_data[k], data.get(k)) for k in ("rows", "schema", "order")
                if k in stored_data and stored_data[k] != data.get(k)]
    return sorted(out)


def _line(field: str, stored: Any, given: Any) -> str:
    return f"{field}: checkpoint {stored!r}, this run {given!r}"


def resume_differences(stored_cfg: dict, cfg: dict, stored_data: dict | None, data: dict | None) -> list[str]:
    """``"field: checkpoint <a>, this run <b>"`` for every field that must match and does not.

    ``*_cfg``: configs as JSON dicts; ``*_data``: data fingerprints (path, rows, schema, order)."""
    return [_line(*c) for c in _changes(stored_cfg, cfg, stored_data, data)]


def resume_check(stored_cfg: dict, cfg: dict, stored_data: dict | None, data: dict | None, step: int,
                 accept: Iterable[str] = ()) -> tuple[list[dict], list[str]]:
    """``(accepted, refused)`` for resuming the checkpoint of ``step``: each accepted change as
    ``{"field", "checkpoint", "run"}`` (a field of ``ACCEPTABLE`` named in ``accept``), each other
    difference as ``"field: checkpoint <a>, this run <b>"``. A run that would stop before the
    checkpoint's step is refused, accepted or not."""
    accept = set(accept)
    accepted, refused = [], []
    for field, stored, given in _changes(stored_cfg, cfg, stored_data, data):
        if field in accept and field in ACCEPTABLE:
            accepted.append({"field": field, "checkpoint": stored, "run": given})
        else:
            refused.append(_line(field, stored, given))
    steps = (cfg.get("train") or {}).get("steps")
    if isinstance(steps, int) and steps < step:
        refused = [r for r in refused if not r.startswith("train.steps:")]
        accepted = [a for a in accepted if a["field"] != "train.steps"]
        refused.append(f"train.steps: this run stops at step {steps}, before the checkpoint's step {step}")
    return accepted, refused


def accepted_fields(fields: str | Iterable[str]) -> list[str]:
    """The fields of ``--accept-change`` (a comma-separated string, or names), sorted; a field
    that is not ``ACCEPTABLE`` is a :class:`ConfigError` naming the ones that are."""
    names = fields.split(",") if isinstance(fields, str) else [n for f in fields for n in f.split(",")]
    names = sorted({n.strip() for n in names if n.strip()})
    for name in names:
        if name not in ACCEPTABLE:
            raise ConfigError(f"{name} cannot change on a resume; it accepts {', '.join(ACCEPTABLE)} (the "
                              "model, data, seed, global batch, optimizer and precision must match the "
                              "checkpoint; the layout may change without asking)")
    return names


def resume_request(resume: bool | str, accept_change: str | Iterable[str], run_name: str | None) -> dict | None:
    """What ``Trainer.fit(resume=..., accept_change=...)`` asks the controller for: None (no
    resume) or ``{"target": run id or checkpoint path, or None for the run named run.name,
    "accept": fields}``. Checked here, before any worker starts. A target URI's credentials are
    taken out (``storage.credentials.take_credentials``), as a config's are."""
    accept = accepted_fields(accept_change or ())
    if not resume:
        if accept:
            raise ConfigError(f"accept_change({accept}) needs resume: it names what a resumed run may change "
                              "(--resume or --resume-from with --accept-change)")
        return None
    target = resume if isinstance(resume, str) else None
    if target is not None and "://" in target:
        # A URI's credentials go where the config's go (storage.credentials), never further: the
        # target travels to the controller, its errors, events and log without them.
        target = take_credentials(target)
    if target is not None and not target.strip():
        raise ConfigError("resume('') names no run: give True (the run named run.name), a run id or a "
                          "checkpoint path")
    if target is not None and "/" in target and "://" not in target:
        # The controller runs in another working directory.
        target = os.path.abspath(os.path.expanduser(target))
    if target is None and run_name is None:
        raise ConfigError("resume by name needs run.name: without it each run is named et-<time> anew, so "
                          "no earlier run has its name; set run.name to the run to continue, or resume "
                          "a run id or checkpoint path (--resume-from)")
    return {"target": target, "accept": accept}

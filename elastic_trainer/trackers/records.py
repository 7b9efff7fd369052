"""What a tracker writes, whichever it is: a step record's scalars, an event's text, the config's
flat parameters, the goodput's figures. Pure functions of the driver's dicts."""

from __future__ import annotations

import io
import json
import re

from ..config import TrainerConfig
from ..reporting.progress import ProgressPrinter
from ..secrets import recorded_config
from ..storage.uris import mask

# Scalar name -> the step record's key. The names are TensorBoard tags and MLflow metric keys alike.
STEP_KEYS = {
    "train/loss": "loss",
    "train/lr": "lr",
    "train/eval_loss": "eval_loss",
    "throughput/tokens_per_s": "tokens_per_s",
    "throughput/step_time_s": "step_time_s",
    "comm/time_s": "comm_time_s",
    "comm/exposed_s": "exposed_comm_s",
    "comm/bytes": "comm_bytes",
    "comm/compression_ratio": "compression_ratio",
    "layout/dp": "dp",
    "layout/pp": "pp",
    "layout/world_size": "world_size",
}
# Derived: the share of the step's wall time spent waiting on communication (exposed, not
# overlapped with compute), as ``results.StepRecord.comm_share``.
COMM_SHARE = "comm/share"
GOODPUT = "goodput/ratio"
# Kinds whose count over the run is a curve too ("events/<kind>").
COUNTED = ("failure", "recovery", "rebalance", "drain", "straggler", "snapshot_dropped", "durable_failed")
# What a step record must hold; the rest is written where present.
REQUIRED = ("step",)


def step_scalars(rec: dict) -> dict[str, float]:
    """The scalars of one step record: every ``STEP_KEYS`` value present and numeric, the
    exposed communication's share of the step, and the goodput where the record has one (a
    ratio, or the controller's goodput report)."""
    out = {name: float(rec[key]) for name, key in STEP_KEYS.items() if _number(rec.get(key))}
    if _number(rec.get("exposed_comm_s")) and _number(rec.get("step_time_s")) and rec["step_time_s"] > 0:
        out[COMM_SHARE] = min(1.0, rec["exposed_comm_s"] / rec["step_time_s"])
    good = rec.get("goodput")
    if isinstance(good, dict):
        good = good.get("goodput")
    if _number(good):
        out[GOODPUT] = float(good)
    return out


def goodput_scalars(goodput: dict | None) -> dict[str, float]:
    """The final goodput report (``{"wall_s", "effective_s", "goodput", "seconds": bucket -> s}``)
    as scalars: the ratio, the wall time and each bucket's seconds."""
    if not goodput:
        return {}
    out = {GOODPUT: goodput.get("goodput"), "goodput/wall_s": goodput.get("wall_s"),
           **{f"goodput/seconds/{b}": s for b, s in (goodput.get("seconds") or {}).items()}}
    return {k: float(v) for k, v in out.items() if _number(v)}


class EventWords:
    """One line saying what an event was (its kind apart): the progress printer's words where it
    has them for the kind, else the event's fields. Secrets masked."""

    def __init__(self, cfg: TrainerConfig):
        self._out = io.StringIO()
        self._printer = ProgressPrinter(cfg, self._out, live=False)

    def line(self, ev: dict) -> str:
        self._out.seek(0)
        self._out.truncate()
        try:
            self._printer.event(ev)
            # The printer's line without its terminal markers ("!! ", "-> ").
            text = re.sub(r"^(!!|->)\s*", "", self._out.getvalue().strip())
        except Exception:  # noqa: BLE001 - an event of fields the printer does not expect: the generic line
            text = ""
        if not text:
            text = ", ".join(f"{k}={_short(v)}" for k, v in ev.items() if k not in ("kind", "time"))
        return mask(text)


def event_detail(ev: dict) -> str:
    """The event's fields as JSON (masked), for readers who want all of it."""
    return mask(json.dumps(ev, default=str, sort_keys=True))


def flat_config(cfg_json: dict, limit: int) -> dict[str, str]:
    """The config as ``section.key`` -> text (nested mappings flattened, lists as JSON), each
    value masked (``scaling.env_vars`` by name only: ``secrets.recorded_config``) and cut to
    ``limit`` characters."""
    out: dict[str, str] = {}

    def walk(prefix: str, v) -> None:
        if isinstance(v, dict) and v:
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
            return
        text = v if isinstance(v, str) else json.dumps(v, default=str)
        text = mask(text)
        out[prefix] = text if len(text) <= limit else text[:limit - 3] + "..."

    walk("", recorded_config(cfg_json))   # a value alone does not say it is a secret; its name does
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _short(v, limit: int = 300) -> str:
    text = v if isinstance(v, str) else json.dumps(v, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."

"""Whether a durable checkpoint may be resumed by a run's config: the model, the data and
the sample order must be the same; the layout (dp, pp, placement) and the rest may change."""

from __future__ import annotations

# Fields that decide what the stored tensors mean and which samples come next.
_DATA_KEYS = ("path", "column", "seq_len", "shuffle")
_TRAIN_KEYS = ("seed", "global_batch_size")


def _flat(prefix: str, d: dict) -> dict:
    return {f"{prefix}.{k}": v for k, v in (d or {}).items()}


def resume_differences(stored_cfg: dict, cfg: dict, stored_data: dict | None, data: dict | None) -> list[str]:
    """``"field: checkpoint <a>, this run <b>"`` for every field that must match and does not.

    ``*_cfg``: configs as JSON dicts; ``*_data``: data fingerprints (path, rows, schema).
    A stored config that lacks a field (an older checkpoint) is not held against it."""
    want, have = {}, {}
    want.update(_flat("model", stored_cfg.get("model")))
    have.update(_flat("model", cfg.get("model")))
    for section, keys in (("data", _DATA_KEYS), ("train", _TRAIN_KEYS)):
        want.update({f"{section}.{k}": stored_cfg.get(section, {}).get(k) for k in keys
                     if k in stored_cfg.get(section, {})})
        have.update({f"{section}.{k}": cfg.get(section, {}).get(k) for k in keys})
    if stored_data and data:
        for k in ("rows", "schema", "order"):
            if k in stored_data:
                want[f"data ({k})"] = stored_data[k]
                have[f"data ({k})"] = data.get(k)
    return [f"{k}: checkpoint {want[k]!r}, this run {have.get(k)!r}"
            for k in sorted(want) if want[k] != have.get(k)]

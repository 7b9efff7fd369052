"""From text to a config: ``section.key=value`` overrides, and pydantic's errors as one message
naming every field and, for an unknown key, the keys allowed there."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .base import YAML_BOOL_WORDS
from ..errors import ConfigError
from ..storage.uris import mask


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` strings; values are parsed as YAML scalars (``3`` -> int, ``true`` -> bool)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        parts = key.strip().split(".")
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            else:
                child = node[part] = dict(child)
            node = child
        node[parts[-1]] = yaml.safe_load(value) if value.strip() else None
    return out


def format_validation_error(e: ValidationError, source: str, root: type[BaseModel]) -> str:
    """pydantic's errors as one message: each field's problem, and for an unknown key the keys ``root``
    allows there."""
    lines = [f"invalid {source}:"]
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown key{_allowed_keys(root, err['loc'])}")
        elif err["type"] == "missing":
            lines.append(f"  {loc}: required but not given")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            given = err.get("input")
            shown = "" if isinstance(given, dict) or given is None else f" (given {given!r})"
            if isinstance(given, bool) and "YAML reads" not in msg:
                # A text field cannot know which of the spellings was written, so it cannot take it back.
                shown += (f": YAML reads an unquoted {'/'.join(YAML_BOOL_WORDS[given])} as a boolean; "
                          "quote the word to give it as text")
            lines.append(f"  {loc}: {msg}{shown}")
    return mask("\n".join(lines))


def _allowed_keys(root: type[BaseModel], loc: tuple) -> str:
    model = root
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return ""
        model = ann
    names = ", ".join(model.model_fields)
    return f" (allowed: {names})" if names else " (this section takes no keys yet)"

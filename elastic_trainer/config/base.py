"""The base of every config section: pydantic, rejecting unknown keys, validating assignments,
and taking the words YAML 1.1 reads as booleans (``off``, ``on``, ``yes``, ``no``) as written."""

from __future__ import annotations

from functools import lru_cache
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

# What PyYAML's safe_load (YAML 1.1) turns into each boolean, in any of its three cases, in job
# files and in ``--set`` values alike: the word the user wrote is one of these.
YAML_BOOL_WORDS: dict[bool, tuple[str, ...]] = {False: ("off", "no", "false"), True: ("on", "yes", "true")}


def _allowed(annotation: Any) -> tuple[bool, tuple[str, ...], bool]:
    """(whether ``annotation`` takes a bool as such, the strings its ``Literal`` parts allow, whether
    it takes a number), through unions, ``Optional`` and ``Annotated`` at any depth."""
    if annotation is bool or annotation is Any:
        return True, (), False
    if annotation in (int, float):
        return False, (), True
    if get_origin(annotation) is Literal:
        args = get_args(annotation)
        return (any(isinstance(a, bool) for a in args), tuple(a for a in args if isinstance(a, str)),
                any(isinstance(a, int | float) and not isinstance(a, bool) for a in args))
    if get_origin(annotation) not in (Union, UnionType, Annotated):
        return False, (), False   # str, dicts, tuples, models: not this validator's business
    parts = [_allowed(a) for a in get_args(annotation)]
    return (any(p[0] for p in parts), tuple(w for p in parts for w in p[1]), any(p[2] for p in parts))


@lru_cache(maxsize=None)
def _field_words(model: type[BaseModel], name: str) -> tuple[bool, tuple[str, ...], bool]:
    """``_allowed`` of one field of ``model``, cached: it runs on every bool a config is given."""
    return _allowed(model.model_fields[name].annotation)


class Strict(BaseModel):
    """A config section: unknown keys are errors, assignments are validated, and a field with
    words among its values takes ``off`` / ``on`` / ``yes`` / ``no`` as those words."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _yaml_booleans_as_written(cls, value: Any, info: ValidationInfo) -> Any:
        # YAML 1.1 has already turned an unquoted `off` into False by the time pydantic sees it, so
        # a field whose choices are words gets the word back; a bool field keeps the bool.
        if not isinstance(value, bool) or info.field_name is None:
            return value
        takes_bool, words, takes_number = _field_words(cls, info.field_name)
        if takes_bool or not words:
            return value
        spellings = YAML_BOOL_WORDS[value]
        matches = [w for w in words if w.lower() in spellings]
        if len(matches) == 1:
            return matches[0]
        allowed = ", ".join(repr(w) for w in words) + (" or a number" if takes_number else "")
        # Refused here rather than left to pydantic, which would read True as 1 in a number field.
        raise ValueError(f"YAML reads an unquoted {'/'.join(spellings)} as the boolean {value}, which this "
                         f"field does not take: give {allowed}")

"""The base of every config section: pydantic, rejecting unknown keys, validating assignments."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

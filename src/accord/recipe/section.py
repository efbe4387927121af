"""The base of every recipe section: unknown keys are errors, defaults are validated too, and no number is NaN or
infinite (YAML reads `.inf` and `.nan` as floats; none of accord's settings means either)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)

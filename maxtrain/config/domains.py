"""Named domains every config section declares its keys with, and the section base class.

Every float is finite (`allow_inf_nan=False`): inf/nan in a config is always a mistake. A
section forbids unknown keys, is frozen, and validates its defaults.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]  # a share in [0, 1]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]


def _not_zero(value: int) -> int:
    if value == 0:
        raise ValueError("must be positive or -1")
    return value


# A count that may also be -1, meaning "all that remain" (mesh degrees) or "off" (profile).
PositiveOrMinusOne = Annotated[int, Field(ge=-1), AfterValidator(_not_zero)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _over_nested_defaults(cls, data: Any) -> Any:
        """A nested section given in part keeps the rest of its default: `checkpoint.local:
        {every_steps: 2}` keeps local's keep of 2, as one source of defaults requires."""
        if not isinstance(data, dict):
            return data
        merged = dict(data)
        for name, field in cls.model_fields.items():
            if isinstance(field.default, BaseModel) and isinstance(merged.get(name), dict):
                merged[name] = {**field.default.model_dump(exclude_unset=True), **merged[name]}
        return merged

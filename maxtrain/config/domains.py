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
        """A nested section or mapping given in part keeps the rest of its default:
        `checkpoint.local: {every_steps: 2}` keeps local's keep of 2, `mesh.rules: {length:
        [context]}` keeps the other sharding rules. One source of defaults: the schema."""
        if not isinstance(data, dict):
            return data
        merged = dict(data)
        for name, field in cls.model_fields.items():
            given = merged.get(name)
            if not isinstance(given, dict) or field.is_required():
                continue
            default = field.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):
                merged[name] = {**default.model_dump(exclude_unset=True), **given}
            elif isinstance(default, dict):
                merged[name] = {**default, **given}
        return merged

"""The base of every config section, and the checks its validators share.

`Strict` forbids unknown keys and reads true/false as no number; the `_check_*` helpers raise
ValueError with the one-line messages that the loader turns into ConfigErrors.
"""

from __future__ import annotations

import difflib
import inspect
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator


class Strict(BaseModel):
    """Base for every config section: unknown keys are errors; true/false is not a number."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info) -> Any:
        # pydantic's lax mode reads true as 1 for int and float fields (`train.steps=true`).
        if isinstance(value, bool) and _wants_number(cls.model_fields[info.field_name].annotation):
            raise ValueError("must be a number, not true/false")
        return value


def _wants_number(annotation: Any) -> bool:
    """An int or float annotation (possibly inside Optional / a union) that does not accept bool."""
    args = set(typing.get_args(annotation)) or {annotation}
    if typing.get_origin(annotation) is typing.Annotated:
        return _wants_number(typing.get_args(annotation)[0])
    return bool(args & {int, float}) and bool not in args


#: Seeds feed torch.manual_seed (< 2**64) and derived streams (seed + 1): kept below 2**63.
SEED_MAX = 2**63 - 1


# ---------------------------------------------------------------------------------------------
# Checks used by the validators
# ---------------------------------------------------------------------------------------------


def _check_micro(batch: int, micro: int, section: str) -> None:
    if micro > batch or batch % micro:
        raise ValueError(
            f"{section}.micro_batch_size ({micro}) must divide {section}.batch_size ({batch})"
        )


def did_you_mean(name: str, choices: typing.Iterable[str]) -> str:
    """ " (did you mean 'x'?)" for the closest of `choices` to `name` (difflib), "" for none."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_name(field: str, name: str, registry: dict) -> None:
    if name not in registry:
        raise ValueError(
            f"{field}: unknown name '{name}'{did_you_mean(name, registry)}; "
            f"valid: {', '.join(sorted(registry))}"
        )


def _check_kwargs(
    field: str, fn: typing.Callable, kwargs: dict, supplied: set[str], *, required: bool = False
) -> None:
    """Check `kwargs` against the keyword-only parameters of `fn` (minus those the trainer supplies).

    With required=True, keyword-only parameters without a default must be present too.
    """
    params = inspect.signature(fn).parameters
    valid = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} - supplied
    for key in kwargs:
        if key not in valid:
            choices = ", ".join(sorted(valid)) or "none"
            raise ValueError(
                f"{field}.{key}: not an argument of {fn.__name__}{did_you_mean(key, valid)}; "
                f"valid: {choices}"
            )
    if required:
        missing = [n for n in sorted(valid) if params[n].default is inspect.Parameter.empty]
        missing = [n for n in missing if n not in kwargs]
        if missing:
            raise ValueError(f"{field}: {fn.__name__} needs {', '.join(missing)}")


def _check_clip_bounds(field: str, args: dict) -> None:
    """Clip bounds [1 − eps_low, 1 + eps_high] must satisfy 0 <= 1 − eps_low <= 1 <= 1 + eps_high."""
    eps_low, eps_high = args.get("eps_low", 0.0), args.get("eps_high", 0.0)
    for name, eps in (("eps_low", eps_low), ("eps_high", eps_high)):
        if eps is not None and not isinstance(eps, int | float):
            raise ValueError(f"{field}.{name}: must be a number, got {eps!r}")
    low = 1.0 - (eps_low or 0.0)
    high = 1.0 + eps_high
    if not 0.0 <= low <= 1.0 <= high or eps_low == 1.0:
        raise ValueError(
            f"{field}: clip bounds out of order: need 0 <= 1 - eps_low < 1 <= 1 + eps_high, "
            f"got eps_low={eps_low}, eps_high={eps_high} (bounds [{low:g}, {high:g}])"
        )

"""What every replication module shares: the `experiment:` section's base model and list types,
its validation with one-line errors (`check_experiment`), a replication's start (`begin`) and a
training stage's config (`stage`). Part of `rlhflab.replications` (re-exported there)."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from rlhflab.config.sections import PrecisionConfig
from rlhflab.errors import ConfigError


class Experiment(BaseModel):
    """Base of each replication's `experiment:` section (unknown keys are errors). `threads`:
    torch threads of the replication's own work (sampling, scoring); its default is
    `precision.threads`' (torch's own), as for every command."""

    model_config = ConfigDict(extra="forbid")

    threads: int | None = Field(PrecisionConfig.model_fields["threads"].default, ge=1)


def _counts(values: list[int]) -> list[int]:
    if not values or any(n < 1 for n in values) or len(set(values)) != len(values):
        raise ValueError("must be a non-empty list of distinct integers >= 1, e.g. [1, 2, 4, 8]")
    return values


def _positive_floats(values: list[float]) -> list[float]:
    if not values or any(not (math.isfinite(v) and v > 0) for v in values):
        raise ValueError("must be a non-empty list of finite numbers > 0, e.g. [0.01, 0.1, 0.5]")
    return values


#: A list of sample counts, sizes or step counts (best-of-n's n, training steps): each >= 1, no
#: repeats, at least one.
Counts = Annotated[list[int], AfterValidator(_counts)]
#: A list of positive finite numbers (DPO's beta values), at least one.
PositiveFloats = Annotated[list[float], AfterValidator(_positive_floats)]


def check_experiment(cls: type[BaseModel], raw: Any, source: str) -> BaseModel:
    """`raw` validated as `cls`.

    Raises:
        ConfigError: one line naming `source`, the key, what it allows and the value given, e.g.
            "rm_overopt.yaml: experiment.ns: must be a non-empty list of distinct integers >= 1,
            e.g. [1, 2, 4, 8] (got [0, 2])".
    """
    try:
        return cls.model_validate(raw or {})
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        got = f" (got {first['input']!r})" if "input" in first else ""
        raise ConfigError(f"{source}: experiment.{key}: {msg}{got}") from None


def begin(cls: type[BaseModel], spec: dict, out: Path, source: str) -> tuple[Any, float, str]:
    """The start of every replication: its `experiment:` section validated as `cls`, the start
    time (`time.perf_counter()`), and the runs root `out/runs` (`out` created); torch threads set
    to `experiment.threads` when given."""
    import time

    import torch

    exp = check_experiment(cls, spec.get("experiment"), source)
    t0 = time.perf_counter()
    if exp.threads:
        torch.set_num_threads(exp.threads)
    out.mkdir(parents=True, exist_ok=True)
    return exp, t0, str(out / "runs")


def _merge(base: dict, update: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def stage(spec: dict, name: str, source: str, **update: Any):
    """The training config of stage `name`: the spec's section with `update` merged in (nested
    dicts merged key by key), validated (`config_from_dict`; errors name the section)."""
    from rlhflab.config import config_from_dict

    if not isinstance(spec.get(name), dict):
        raise ConfigError(f"{source}: missing section '{name}' (a training config)")
    return config_from_dict(_merge(spec[name], update), source=f"{source} [{name}]")

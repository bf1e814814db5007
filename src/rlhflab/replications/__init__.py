"""Small-scale replications of published RLHF results (`rlhflab replicate NAME [CONFIG]`).

Each replication is one module with a `run(spec: dict, out: Path) -> dict` and a config in
`configs/replications/<name>.yaml` (the CPU size run for docs/replications.md) beside
`<name>_gpu.yaml` (the size for a GPU). A config has an `experiment:` section (the replication's
own settings, checked by its pydantic model: unknown keys are errors) and one section per training
stage, each a complete training config (`rlhflab train`'s format) that the replication completes
(start model, run root) and validates before anything runs.

    rm-overopt     reward-model over-optimisation (Gao et al. 2022): best-of-n against proxies
                   trained on 4 data sizes and GRPO against the largest, gold against √KL with
                   the paper's fits (cells: one per proxy, one per RL seed)
    prm-orm        PRM vs ORM (Lightman et al. 2023) on chained arithmetic with exact step labels:
                   best-of-N selection accuracy against N (`prm-orm-gsm8k`: its former name)
    r1-zero        R1-Zero trends (DeepSeek-R1 §2.2): GRPO from a two-style base (short / worked
                   answers) with correctness + format rewards; do held-out correctness and length
                   rise together? Controls: Dr. GRPO, no format reward; seeds × arms as cells
    dpo-overopt    DPO over-optimisation (Rafailov et al. 2024): one offline run per β and seed,
                   gold and KL(π‖π_ref) on held-out problems every few steps; gold against √KL
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from rlhflab.config.sections import PrecisionConfig
from rlhflab.errors import ConfigError

#: name → (module, default config)
REPLICATIONS = {
    "rm-overopt": ("rlhflab.replications.rm_overopt", "configs/replications/rm_overopt.yaml"),
    "prm-orm": ("rlhflab.replications.prm_orm", "configs/replications/prm_orm.yaml"),
    "dpo-overopt": ("rlhflab.replications.dpo_overopt", "configs/replications/dpo_overopt.yaml"),
    "r1-zero": ("rlhflab.replications.r1_zero", "configs/replications/r1_zero.yaml"),
}

#: former name → name (still accepted by `rlhflab replicate`)
ALIASES = {"prm-orm-gsm8k": "prm-orm"}

#: name → one line: the published result and what the replication measures (`replicate --list`)
DESCRIPTIONS = {
    "r1-zero": "R1-Zero trends (DeepSeek-R1 §2.2): GRPO from a two-style base with correctness + "
    "format rewards; held-out correctness and response length rising together, with Dr. GRPO "
    "and no-format-reward controls",
    "rm-overopt": "reward-model over-optimisation (Gao et al. 2022): best-of-n against proxies "
    "trained on 4 data sizes and GRPO against the largest; gold vs √KL with d(α − βd) and "
    "d(α − β log d) fits and a pre-registered verdict",
    "dpo-overopt": "DPO over-optimisation (Rafailov et al. 2024): one run per β and seed, "
    "measured every few steps; gold against √KL(π‖π_ref) per β",
    "prm-orm": "PRM vs ORM (Lightman et al. 2023) on chained arithmetic with exact step labels; "
    "best-of-N selection accuracy against N up to 64, 3 seeds",
}


def describe() -> list[str]:
    """One line per replication: its name, its default config and what it replicates
    (`rlhflab replicate --list`)."""
    width = max(map(len, REPLICATIONS))
    return [
        f"{name:<{width}}  {DESCRIPTIONS[name]} ({REPLICATIONS[name][1]})" for name in REPLICATIONS
    ]


def result_file(name: str, out: str | Path) -> str:
    """The JSON a replication writes into `out` with every number: `<out>/<module>.json`."""
    return str(Path(out) / f"{REPLICATIONS[name][0].rsplit('.', 1)[-1]}.json")


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


def run_replication(
    name: str,
    config: str | None,
    out: str,
    overrides: list[str],
    *,
    only: str | None = None,
    report_only: bool = False,
    print_fn=None,
) -> dict:
    """Load the replication's config (dotted overrides applied), run it into `out`: every cell,
    the share `only` ("i/N") of its cells, or (`report_only`) only the report of finished cells
    (`rlhflab.replications.cells`). A replication not split into cells takes neither option.

    Raises:
        ConfigError: unknown name, missing config, or `--only` / `--report` given to a
            replication without cells.
    """
    import importlib

    from rlhflab.config import apply_overrides, read_yaml
    from rlhflab.config.base import did_you_mean
    from rlhflab.replications.cells import is_cellular, run_cells

    name = ALIASES.get(name, name)
    if name not in REPLICATIONS:
        raise ConfigError(
            f"replicate: unknown replication '{name}'{did_you_mean(name, REPLICATIONS)}; "
            f"valid: {', '.join(REPLICATIONS)}"
        )
    module, default = REPLICATIONS[name]
    path = Path(config or default)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    spec = apply_overrides(read_yaml(path) or {}, overrides)
    mod = importlib.import_module(module)
    if is_cellular(mod):
        return run_cells(name, mod, spec, Path(out), str(path), only=only,
                         report_only=report_only, print_fn=print_fn or print)  # fmt: skip
    if only is not None or report_only:
        raise ConfigError(f"replicate {name}: --only/--report need a replication split into cells")
    return mod.run(spec, Path(out), source=str(path))

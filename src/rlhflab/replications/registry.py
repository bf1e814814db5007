"""The replications as one table (name → module and default config, former names, one-line
descriptions) and `run_replication`, which `rlhflab replicate` calls. Part of
`rlhflab.replications` (re-exported there)."""

from __future__ import annotations

from pathlib import Path

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
    "measured every few steps; gold against √KL(π‖π_ref) over every β and checkpoint",
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


def run_replication(
    name: str,
    config: str | None,
    out: str,
    overrides: list[str],
    *,
    only: str | None = None,
    report_only: bool = False,
    jobs: int | str = 1,
    print_fn=None,
) -> dict:
    """Load the replication's config (dotted overrides applied), run it into `out`: every cell,
    the share `only` ("i/N") of its cells, or (`report_only`) only the report of finished cells
    (`rlhflab.replications.cells`), `jobs` cells at a time (an int, or "auto": `auto_jobs`). A
    replication not split into cells takes none of these options.

    Raises:
        ConfigError: unknown name, missing config, or `--only` / `--report` given to a
            replication without cells.
    """
    import importlib

    from rlhflab.config import apply_overrides, read_yaml
    from rlhflab.config.base import did_you_mean
    from rlhflab.replications.cells import auto_jobs, is_cellular, run_cells

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
    if jobs == "auto":
        jobs = auto_jobs(spec)
    elif not isinstance(jobs, int):
        try:
            jobs = int(jobs)
        except ValueError:
            raise ConfigError(
                f"replicate --jobs '{jobs}': expected a whole number or auto"
            ) from None
    if is_cellular(mod):
        return run_cells(name, mod, spec, Path(out), str(path), only=only,
                         report_only=report_only, jobs=jobs, print_fn=print_fn or print)  # fmt: skip
    if only is not None or report_only:
        raise ConfigError(f"replicate {name}: --only/--report need a replication split into cells")
    return mod.run(spec, Path(out), source=str(path))

"""`rlhflab compare`: run several presets on the same task and seeds, then plot and tabulate.

    rlhflab compare configs/pg/grpo.yaml configs/pg/rloo.yaml --seeds 3 model.name_or_path=...

Writes `<root>/compare-<timestamp>/`:
    runs/<preset>-s<seed>-<ts>/   every training run, complete (config, metrics, model, ...)
    comparison.png              the training signal (policy gradients: rollout reward; direct
                                alignment: DPO margin) and held-out accuracy against step and
                                against wall-clock, mean over seeds with a min-max band
    comparison.md               one row per preset: composition, budget, accuracy beside the
                                majority-answer baseline, signal, time (mean ± s.e. over seeds)
                                (direct alignment adds held-out preference accuracy); then every
                                preset against the first, paired by seed (difference, paired and
                                unpaired 95% intervals) and a conclusion line computed from them
    results.json                the same numbers, plus every run's directory

The same overrides go to every preset (task, model, steps, ...), and seed i of every preset uses
`seed=i`, so presets see the same prompts order and initial model; they differ only in their parts.
An override whose key only some presets have (`rollout.group_size` beside a DPO preset,
`loss.args.beta` beside a GRPO one) goes to those presets only (`overrides` of each preset in
results.json); a key that no preset has is an error.
Presets of both families (`policy_gradient` and `direct_alignment`) may be compared side by side
on the same task: the table then has one row per preset with its family, held-out accuracy and its
own training signal (reward or DPO margin, named in the row).
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

from rlhflab.config import load_config
from rlhflab.errors import ConfigError
from rlhflab.eval.accuracy import mean_and_stderr
from rlhflab.next_steps import check_start_model
from rlhflab.rundir import create_run_dir
from rlhflab.serialize import write_json_atomic, write_text_atomic
from rlhflab.tracking import read_metrics


def metric_series(rows: list[dict], key: str) -> list[tuple[int, float, float]]:
    """(step, time_s, value) for every row that has `key`."""
    return [
        (r["step"], r.get("time_s", 0.0), r[key])
        for r in rows
        if isinstance(r.get(key), int | float)
    ]


def _mean_over_seeds(series: list[list[tuple[int, float, float]]]):
    """Steps present in every seed's series -> (steps, mean time, mean, min, max)."""
    common = sorted(set.intersection(*[{s for s, _, _ in ser} for ser in series]))
    out = []
    for step in common:
        vals = [v for ser in series for s, _, v in ser if s == step]
        times = [t for ser in series for s, t, _ in ser if s == step]
        out.append((step, statistics.mean(times), statistics.mean(vals), min(vals), max(vals)))
    return out


def mean_se(values: list[float | None]) -> dict:
    """{"mean", "se", "n"} over the values present (None left out): mean and standard error of
    the mean (`eval.accuracy.mean_and_stderr`); "se" None below 2 values, "mean" None for none."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"mean": None, "se": None, "n": 0}
    mean, se = mean_and_stderr(vals)
    return {"mean": mean, "se": se if len(vals) > 1 else None, "n": len(vals)}


def _fmt(values: list[float | None], digits: int = 3) -> str:
    """ "0.600 ± 0.100": mean ± standard error of the mean over seeds (sample std with Bessel's
    correction over √n, `eval.accuracy.mean_and_stderr`), as every rlhflab table; one value
    alone; "–" for none."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "–"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f}"
    mean, se = mean_and_stderr(vals)
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


# Per family: the metric plotted and tabulated beside held-out accuracy, and its label.
SIGNALS = {
    "policy_gradient": ("rollout/reward_mean", "reward"),
    "direct_alignment": ("dpo/margin", "margin"),
}


def _composition(cfg) -> str:
    """One line naming the preset's parts (what differs between rows)."""
    if cfg.trainer == "direct_alignment":
        args = ", ".join(f"{k}={v}" for k, v in cfg.loss.args.items())
        rounds = f", {cfg.verifiable.rounds} rounds" if cfg.verifiable.rounds > 1 else ""
        return f"{cfg.loss.name}({args}){rounds}"
    kl = "none" if cfg.kl.coef == 0 else f"{cfg.kl.estimator} {cfg.kl.placement} β={cfg.kl.coef:g}"
    adv = cfg.loss.advantage + (" +DS" if cfg.rollout.dynamic_sampling.enabled else "")
    return f"{adv} / {cfg.loss.surrogate} / {cfg.loss.aggregation} / {kl}"


def _per_step(cfg) -> int:
    """Work per step: completions (policy gradients) or preference pairs (direct alignment)."""
    if cfg.trainer == "direct_alignment":
        return cfg.train.batch_size
    return cfg.rollout.prompts_per_step * cfg.rollout.group_size


def overrides_per_preset(presets: list[str], overrides: list[str]) -> dict[str, list[str]]:
    """The overrides each preset gets: every `key=value` goes to the presets whose config class
    has `key` (`config.config_has_key`), so `rollout.group_size=4` reaches GRPO beside DPO and
    `loss.args.beta=0.2` reaches DPO beside GRPO. A preset whose file or `trainer` cannot be read gets
    every override (loading it then names the problem).

    Raises:
        ConfigError: one line naming the key and the presets, when no preset has the key.
    """
    from rlhflab.config import CONFIG_CLASSES, config_has_key, key_hint, read_yaml

    classes = {}
    for p in presets:
        raw = read_yaml(p) if Path(p).is_file() else None
        trainer = raw.get("trainer") if isinstance(raw, dict) else None
        classes[p] = CONFIG_CLASSES.get(trainer) if isinstance(trainer, str) else None
    out: dict[str, list[str]] = {p: [] for p in presets}
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        takers = [
            p
            for p, cls in classes.items()
            if cls is None or "=" not in item or config_has_key(cls, key)
        ]
        if not takers:
            hints = [key_hint(cls, key) for cls in classes.values() if cls is not None]
            hint = next((h for h in hints if h), "")
            raise ConfigError(
                f"compare: no preset has the config key '{key}' ({', '.join(presets)}){hint}"
            )
        for p in takers:
            out[p].append(item)
    return out


def run_compare(
    presets: list[str],
    *,
    seeds: int = 3,
    overrides: list[str] | None = None,
    root: str = "runs",
) -> dict:
    """Train every preset with seeds 0..seeds−1 and write the comparison (see module doc).

    Returns:
        {"out_dir", "wall_s", "table" (comparison.md), "seeds", "presets": {name:
        {"headline_name", "heldout_accuracy_before", "heldout_accuracy" (per seed), "heldout",
        "heldout_before" (`mean_se` over seeds)}}, "paired" (`paired_comparisons` of the held-out
        headline against the first preset), "conclusion"}; every number is in results.json."""
    from rlhflab.trainers import run_config

    if not presets:
        raise ConfigError("compare: give at least one preset")
    if seeds < 1:
        raise ConfigError(f"compare: --seeds must be >= 1 (got {seeds})")
    overrides = list(overrides or [])
    per_preset = overrides_per_preset(presets, overrides)
    # Validate every config before the first (long) run starts.
    configs = {
        p: [load_config(p, [*per_preset[p], f"seed={s}"]) for s in range(seeds)] for p in presets
    }
    family = next(iter(configs.values()))[0].trainer
    for p, cfgs in configs.items():
        if cfgs[0].trainer not in SIGNALS:
            raise ConfigError(
                f"compare: {p} is a '{cfgs[0].trainer}' preset; compare takes "
                f"{' or '.join(SIGNALS)} presets"
            )
        if cfgs[0].trainer != family:
            family = "mixed"  # GRPO beside DPO: held-out accuracy is the shared number
        check_start_model(cfgs[0])
    signal_key, signal_name = SIGNALS.get(family, ("training signal", "reward or margin"))
    out = create_run_dir(root, "compare")
    t0 = time.perf_counter()
    results: dict = {
        "presets": {},
        "seeds": seeds,
        "overrides": overrides,
        "family": family,
        "signal": signal_key,
        "signal_name": signal_name,
    }
    for p in presets:
        name = Path(p).stem
        runs = []
        for s in range(seeds):
            cfg = load_config(
                p,
                [*per_preset[p], f"seed={s}", f"run.root={out / 'runs'}", f"run.name={name}-s{s}"],
            )
            res = run_config(cfg)
            rows = read_metrics(Path(res["run_dir"]) / "metrics.jsonl")
            runs.append({"result": res, "rows": rows})
        cfg0 = configs[p][0]
        own_signal = SIGNALS[cfg0.trainer][0]
        reward = [metric_series(r["rows"], own_signal) for r in runs]
        # the held-out headline (a correctness when the task has one, else the named reward)
        acc = [metric_series(r["rows"], "eval/headline") or metric_series(r["rows"], "eval/accuracy")
               for r in runs]  # fmt: skip
        tail = [statistics.mean(v for _, _, v in ser[-10:]) if ser else None for ser in reward]
        results["presets"][name] = {
            "path": str(p),
            "family": cfg0.trainer,
            "signal": own_signal,
            "overrides": per_preset[p],
            "composition": _composition(cfg0),
            "steps": [r["result"]["steps"] for r in runs],
            "completions_per_step": _per_step(cfg0),
            "headline_name": _headline(runs[0]["result"])[0],
            "heldout_accuracy_before": [_headline(r["result"])[2] for r in runs],
            "heldout_accuracy": [_headline(r["result"])[1] for r in runs],
            "heldout_majority_baseline": [
                r["result"].get("heldout_majority_baseline") for r in runs
            ],
            "heldout_n": runs[0]["result"]["heldout_n"],
            "reward_last10": tail,
            "heldout_pref_accuracy_before": [
                r["result"].get("heldout_pref_accuracy_before") for r in runs
            ],
            "heldout_pref_accuracy": [r["result"].get("heldout_pref_accuracy") for r in runs],
            "wall_s": [r["result"]["wall_s"] for r in runs],
            "run_dirs": [r["result"]["run_dir"] for r in runs],
            "curves": {
                "reward": _mean_over_seeds(reward) if all(reward) else [],
                "accuracy": _mean_over_seeds(acc) if all(acc) else [],
            },
        }
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    # every preset against the first, paired by seed (seed i of each: the same prompts order and
    # initial model)
    arms = {n: dict(enumerate(r["heldout_accuracy"])) for n, r in results["presets"].items()}
    first = next(iter(results["presets"]))
    results["baseline"] = first
    results["paired"] = paired_comparisons(arms, first)
    results["conclusion"] = conclusion_line(results["paired"], first)
    write_json_atomic(out / "results.json", results)
    write_text_atomic(out / "comparison.md", comparison_table(results))
    plot_comparison(results, out / "comparison.png")
    results["out_dir"] = str(out)
    keep = ("headline_name", "heldout_accuracy_before", "heldout_accuracy")
    presets = {
        n: {**{k: r[k] for k in keep}, "heldout": mean_se(r["heldout_accuracy"]),
            "heldout_before": mean_se(r["heldout_accuracy_before"])}
        for n, r in results["presets"].items()
    }  # fmt: skip
    return {
        "out_dir": str(out),
        "wall_s": results["wall_s"],
        "table": str(out / "comparison.md"),
        "seeds": seeds,
        "presets": presets,
        "paired": results["paired"],
        "conclusion": results["conclusion"],
    }


def paired_comparisons(arms: dict[str, dict[int, float | None]], baseline: str, *,
                       ci: str = "t") -> list[dict]:  # fmt: skip
    """Every arm against arm `baseline`, paired by seed. `arms`: {label: {seed: metric}} (a
    missing or non-finite metric leaves its seed out). For the seeds both arms have: the
    per-seed differences (arm − baseline) with their 95% interval — Student t over the seeds
    (`stats.paired_difference`; `ci="t"`) or percentile bootstrap over them
    (`stats.paired_bootstrap`; `ci="bootstrap"`) —, beside the unpaired (Welch) interval of the same runs' means,
    the ratio of the two widths, and the paired seeds needed for 80% power at the observed
    difference and paired s.d. (`stats.seeds_needed`; None when it cannot be said).

    Returns [{"label", "seeds", "mean", "lo", "hi", "sd", "unpaired_lo", "unpaired_hi",
    "width_ratio", "seeds_for_80_power"}] in `arms` order, the baseline left out (intervals None
    below 2 paired seeds)."""
    from rlhflab.stats import paired_bootstrap, paired_difference, seeds_needed, welch_interval

    if ci not in ("t", "bootstrap"):
        raise ConfigError(f"paired comparisons: ci must be t or bootstrap (got {ci!r})")

    def finite(values: dict) -> dict:
        return {s: v for s, v in values.items() if isinstance(v, int | float) and math.isfinite(v)}

    ref = finite(arms[baseline])
    out = []
    for label, values in arms.items():
        if label == baseline:
            continue
        mine = finite(values)
        seeds = sorted(set(ref) & set(mine))
        row = {"label": label, "seeds": seeds, "mean": None, "lo": None, "hi": None, "sd": None,
               "unpaired_lo": None, "unpaired_hi": None, "width_ratio": None,
               "seeds_for_80_power": None}  # fmt: skip
        if seeds:
            arm, b = [mine[s] for s in seeds], [ref[s] for s in seeds]
            d = paired_difference(arm, b)
            if ci == "bootstrap" and len(seeds) > 1:
                _, d["lo"], d["hi"] = paired_bootstrap(arm, b)
            _, ulo, uhi = welch_interval(arm, b)
            row.update(mean=d["mean"], lo=d["lo"], hi=d["hi"], sd=d["sd"], unpaired_lo=ulo,
                       unpaired_hi=uhi)  # fmt: skip
            if d["lo"] is not None and ulo is not None and uhi > ulo:
                row["width_ratio"] = (d["hi"] - d["lo"]) / (uhi - ulo)
            if d["sd"]:
                row["seeds_for_80_power"] = seeds_needed(d["sd"], d["mean"])
        out.append(row)
    return out


def conclusion_line(comparisons: list[dict], baseline: str | None) -> str:
    """The conclusion the paired intervals support, computed: which points differ from the
    baseline at 95% (interval excluding 0), and which cannot be told apart from it."""
    if not comparisons:
        return "Only the baseline: nothing to compare with it."
    differ = [c for c in comparisons if c["lo"] is not None and (c["lo"] > 0 or c["hi"] < 0)]
    same = [c for c in comparisons if c not in differ]
    parts = []
    for c in differ:
        word = "higher" if c["lo"] > 0 else "lower"
        parts.append(f"{c['label']} is {word} than {baseline} ({_ci_text(c)})")
    if same:
        told = ", ".join(f"{c['label']} ({_ci_text(c)})" for c in same)
        parts.append(f"not told apart from {baseline}: {told}")
    return "At 95% (paired by seed): " + "; ".join(parts) + "."


def _ci_text(c: dict) -> str:
    if c["mean"] is None:
        return "no paired seed"
    if c["lo"] is None:
        return f"{c['mean']:+.3f}, one paired seed, no interval"
    return f"{c['mean']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}]"


def paired_table(comparisons: list[dict], baseline: str, what: str = "arm") -> str:
    """The markdown table of `paired_comparisons` against `baseline` (`what`: the arms' noun)."""
    head = (f"| {what} − {baseline} | paired seeds | difference, paired 95% CI | unpaired (Welch) "
            "95% CI | width paired / unpaired | seeds for 80% power |")  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|"]
    for c in comparisons:
        unpaired = ("–" if c["unpaired_lo"] is None
                    else f"[{c['unpaired_lo']:+.3f}, {c['unpaired_hi']:+.3f}]")  # fmt: skip
        ratio = "–" if c["width_ratio"] is None else f"{c['width_ratio']:.2f}"
        power = "–" if c["seeds_for_80_power"] is None else str(c["seeds_for_80_power"])
        lines.append(f"| {c['label']} | {len(c['seeds'])} | {_ci_text(c)} | {unpaired} | "
                     f"{ratio} | {power} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _headline(result: dict) -> tuple[str, float | None, float | None]:
    """(name, value, value before training) of a run's held-out headline (final_results.json's
    `headline`; runs from before it existed: heldout_accuracy, a correctness)."""
    h = result.get("headline")
    if isinstance(h, dict):
        return h.get("name"), h.get("value"), h.get("before")
    name = "correctness" if result.get("heldout_metric", "accuracy") == "accuracy" else "reward"
    return name, result.get("heldout_accuracy"), result.get("heldout_accuracy_before")


def comparison_table(results: dict) -> str:
    """The markdown table of a comparison (one row per preset; mean ± s.e. over seeds). The
    held-out columns are each run's headline (`headline_name`: "correctness (...)" -> "acc.",
    a weighted reward -> "reward")."""
    pairs = results.get("family") == "direct_alignment"
    mixed = results.get("family") == "mixed"
    signal = results.get("signal_name", "reward")
    names = {r.get("headline_name") for r in results["presets"].values()} - {None}
    headline = " / ".join(sorted(names)) or "correctness"
    acc = "acc." if all(n.startswith("correctness") for n in names) else "headline"
    if mixed:
        head = (
            f"| preset | family: composition | steps × completions or pairs | held-out {acc} before "
            f"| held-out {acc} after | majority baseline | training signal (last 10 steps) "
            "| wall s / run |"
        )
    elif pairs:
        head = (
            "| preset | loss | steps × pairs | held-out pref. acc. before | held-out pref. acc. "
            f"after | held-out {acc} before | held-out {acc} after | majority baseline | {signal} "
            "(last 10 steps) | wall s / run |"
        )
    else:
        head = (
            "| preset | advantage / surrogate / aggregation / KL | steps × completions | "
            f"held-out {acc} before | held-out {acc} after | majority baseline | "
            f"{signal} (last 10 steps) | wall s / run |"
        )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for name, r in results["presets"].items():
        steps = sorted(set(r["steps"]))
        pref = (
            f"{_fmt(r['heldout_pref_accuracy_before'])} | {_fmt(r['heldout_pref_accuracy'])} | "
            if pairs
            else ""
        )
        comp = f"{r['family']}: {r['composition']}" if mixed else r["composition"]
        sig = f"{r['signal']} {_fmt(r['reward_last10'])}" if mixed else _fmt(r["reward_last10"])
        lines.append(
            f"| {name} | {comp} | {'/'.join(map(str, steps))} × "
            f"{r['completions_per_step']} | {pref}{_fmt(r['heldout_accuracy_before'])} | "
            f"{_fmt(r['heldout_accuracy'])} | {_fmt(r.get('heldout_majority_baseline', []))} | "
            f"{sig} | "
            f"{_fmt(r['wall_s'], 0)} |"
        )
    n = results["seeds"]
    heldout = next(iter(results["presets"].values()))["heldout_n"]
    lines.append("")
    lines.append(
        f"Mean ± s.e. (standard error of the mean) over {n} seed{'s' if n > 1 else ''}; the "
        f"held-out headline ({headline}) is greedy, on "
        f"{heldout} problems; the majority baseline answers every one with the most common "
        "training answer. Overrides (each to the presets that have its key): "
        f"`{' '.join(results['overrides']) or 'none'}`."
    )
    if results.get("paired"):
        lines += [
            "",
            f"Held-out {acc}, every preset against {results['baseline']}, paired by seed (seed i of "
            "each: the same prompts order and initial model): the mean difference with its 95% t "
            "interval, beside the unpaired (Welch) interval of the same runs:",
            "",
            paired_table(results["paired"], results["baseline"], "preset").rstrip("\n"),
            "",
            f"Conclusion: {results['conclusion']}",
        ]
    return "\n".join(lines) + "\n"


def plot_comparison(results: dict, path: Path) -> None:
    """2×2 figure: reward and held-out accuracy against step and wall-clock (mean, min-max band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), dpi=100)
    # One colour per preset in every panel (a preset without a curve in one panel must not shift
    # the others' colours); tab20 beyond ten presets.
    cmap = plt.get_cmap("tab10" if len(results["presets"]) <= 10 else "tab20")
    for i, (name, r) in enumerate(results["presets"].items()):
        color = cmap(i % cmap.N)
        for row, key in enumerate(("reward", "accuracy")):
            curve = r["curves"][key]
            if not curve:
                continue
            steps, times, mean, lo, hi = zip(*curve, strict=True)
            for col, x in enumerate((steps, times)):
                ax = axes[row][col]
                marker = "o" if len(x) < 15 else None
                ax.plot(x, mean, label=name, color=color, marker=marker, ms=3)
                ax.fill_between(x, lo, hi, alpha=0.15, color=color)
    signal = results.get("signal", "rollout/reward_mean")
    names = {r.get("headline_name") for r in results["presets"].values()} - {None}
    held = f"held-out {' / '.join(sorted(names)) or 'accuracy'}"
    titles = [[signal, signal], [held, held]]
    for row in range(2):
        for col in range(2):
            ax = axes[row][col]
            ax.set_title(titles[row][col])
            ax.set_xlabel("step" if col == 0 else "wall-clock (s)")
            ax.grid(alpha=0.3)
    axes[1][0].legend(fontsize=7)  # the accuracy panel has every preset
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

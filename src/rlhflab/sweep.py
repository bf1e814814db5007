"""`rlhflab sweep`: one training config over a grid of overrides × seeds, as a campaign folder.

    rlhflab sweep configs/pg/quickstart_grpo.yaml --grid kl.coef=0,0.05,0.2 --seeds 3 \\
        --slug quickstart-beta model.name_or_path=runs/sft/model

Every grid point (the product of the `--grid` values, in the order given) is trained with seeds
0..N−1 (`seed=i`, as in `rlhflab compare`), one run after another, through the ordinary training
harness (`rlhflab.trainers.run_config`). Writes `<root>/YYYY-MM-DD-<slug>/`:

    sweep.json     what the campaign is: config file, fixed overrides, grid, seeds, metric, and
                   the resolved config of the first cell (so a changed config is detected)
    runs/<cell>-<timestamp>/   every run, complete (config, metrics, checkpoints, model: not for git;
                   the folder's `.gitignore` keeps them out, and the lock files)
    README.md      the question (`--question`, else a placeholder line), the command and the exact overrides, one row
                   per grid point with mean ± standard error over seeds of the headline held-out
                   metric (default: final_results.json's named `headline`, e.g. "correctness (task
                   verifier)"; runs from before it existed: `heldout_accuracy`; or any key of
                   final_results.json), its value before training, the KL to the reference
                   (`policy/kl_ref` when the run logged it, else `policy/kl`), the rollout reward
                   and the wall-clock; every point against the baseline point paired by seed
                   (`paired_comparisons`: difference, paired and unpaired 95% intervals, seeds
                   for 80% power); plots; a "Conclusion:" line computed from the paired intervals
    results.json   the same numbers, per run and per grid point
    metric_vs_grid.png   the headline metric against the (first) grid value, error bars ± s.e.
    curves.png     held-out metric, rollout reward and KL against step, mean ± s.e. over seeds

Resuming: run the same command again (`--resume` too: it refuses when there is nothing to
continue). A cell whose run finished (`final_results.json` with `status: complete`) is skipped; a
cell interrupted mid-way continues from its newest committed checkpoint (`run.resume=auto`, the
harness's own resume). The campaign folder is found again by its slug (`<root>/*-<slug>`, any
date); a different config, override list, grid or metric, or fewer seeds, refuses with one line
naming the difference; more seeds add runs to the campaign.

One sweep at a time: a sweep locks its campaign folder (`.lock`, the run directory's lock,
`rlhflab.rundir.take_lock`) for as long as it runs, so a second sweep into the same folder is
refused in one line naming the folder and the holder's PID instead of training cells twice. The
kernel drops the lock when its process ends, however it ends: after a crash, the same command
(or `--resume`) takes it over. `--only i/N` shares run at once: each holds the folder's lock
shared and its own `.lock-only-<i>-of-<N>` exclusively, so a share runs once and never beside a
whole sweep; `--report` holds the folder's lock shared (refused while a whole sweep runs).

Many GPUs: cells are independent runs. `--only i/N` runs the cells j with j mod N = i (0 ≤ i < N)
and writes no report; `--report` trains nothing and gathers every finished run into README.md
(docs/sweeps.md shows a Slurm job array and one process per GPU on one node).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

from rlhflab.compare import conclusion_line, metric_series, paired_comparisons, paired_table
from rlhflab.errors import ConfigError
from rlhflab.eval.accuracy import mean_and_stderr
from rlhflab.rundir import LOCK, newest_complete_run, take_lock
from rlhflab.serialize import write_json_atomic, write_text_atomic
from rlhflab.tracking import read_metrics

MANIFEST = "sweep.json"
#: The manifest fields that must match when a campaign is continued.
_FIXED = ("config", "overrides", "grid", "seeds", "metric")
#: Logged metrics summarised per run: the mean over its last `_TAIL` logged values.
_TAIL = 10
_KL = "policy/kl"
#: The KL to the reference (or the initial policy) measured every step when logged (β > 0, or β = 0
#: with LoRA or `kl.track_initial`); preferred to `_KL` in the table and curves.
_KL_REF = "policy/kl_ref"
#: `--metric` default: final_results.json's named held-out headline.
HEADLINE = "headline"
_REWARD = "rollout/reward_mean"


def _split_values(text: str) -> list[str]:
    """`0,0.05,[1,2]` → ['0', '0.05', '[1,2]']: commas inside [] or {} do not split."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [v.strip() for v in out]


def parse_grid(items: list[str], config_path: str | Path) -> dict[str, list[str]]:
    """`["kl.coef=0,0.05", "optim.lr=1e-4,3e-4"]` → {"kl.coef": ["0", "0.05"], "optim.lr": [...]}.

    Values stay text (each becomes the override `key=value`, read like any other override). Keys
    are checked against the config class of the file's `trainer` (`config.config_has_key`).

    Raises:
        ConfigError: one line, naming the item: no `=`, an empty value, a repeated key or value,
            or a key the config does not have (with a did-you-mean hint).
    """
    from rlhflab.config import CONFIG_CLASSES, config_has_key, key_hint, read_yaml

    if not items:
        raise ConfigError("sweep: give at least one --grid key=v1,v2,...")
    path = Path(config_path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    raw = read_yaml(path)
    trainer = raw.get("trainer") if isinstance(raw, dict) else None
    cls = CONFIG_CLASSES.get(trainer) if isinstance(trainer, str) else None
    if cls is None:
        raise ConfigError(f"{path}: 'trainer' must be one of {', '.join(sorted(CONFIG_CLASSES))}")
    grid: dict[str, list[str]] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"sweep --grid '{item}': expected key.path=v1,v2,...")
        key, text = (s.strip() for s in item.split("=", 1))
        values = _split_values(text)
        if not key or any(not v for v in values):
            raise ConfigError(f"sweep --grid '{item}': a key and non-empty values are needed")
        if not config_has_key(cls, key):
            hint = key_hint(cls, key)
            raise ConfigError(f"sweep --grid '{item}': unknown config key '{key}'{hint}")
        if key in grid:
            raise ConfigError(f"sweep --grid: key '{key}' given twice")
        if len(set(values)) != len(values):
            raise ConfigError(f"sweep --grid '{item}': a value is repeated")
        if key == "seed":
            raise ConfigError("sweep --grid: 'seed' is set by --seeds, not by the grid")
        grid[key] = values
    return grid


def grid_points(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """Every combination of the grid's values, the first key varying slowest."""
    keys = list(grid)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*grid.values())]


def point_label(point: dict[str, str]) -> str:
    """`{"kl.coef": "0.05"}` → "kl.coef=0.05" (several keys joined by ", ")."""
    return ", ".join(f"{k}={v}" for k, v in point.items())


def cell_name(index: int, point: dict[str, str], seed: int) -> str:
    """The run name of grid point `index` at `seed`: `p00-coef0.05-s0` (run-name characters)."""
    body = "_".join(f"{k.split('.')[-1]}{v}" for k, v in point.items())
    body = re.sub(r"[^A-Za-z0-9._-]+", "-", body).strip("-.") or "x"
    return f"p{index:02d}-{body[:60]}-s{seed}"


def parse_only(text: str | None, *, command: str = "sweep") -> tuple[int, int] | None:
    """`"2/8"` → (2, 8): this job runs the cells j with j mod 8 = 2. None → every cell.

    Raises:
        ConfigError: not `i/N` with integers 0 <= i < N (the message names `command`).
    """
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise ConfigError(f"{command} --only '{text}': expected i/N with 0 <= i < N (e.g. 0/4)")
    return int(m.group(1)), int(m.group(2))


def _slug_default(config: str | Path, grid: dict) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", "-".join([Path(config).stem, *grid]))


def campaign_dir(root: str | Path, slug: str) -> Path:
    """`<root>/YYYY-MM-DD-<slug>`: an existing campaign of that slug (any date; the newest), else
    today's (not created here).

    Raises:
        ConfigError: the slug has characters other than letters, digits, '.', '_', '-'.
    """
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", slug) or ".." in slug:
        raise ConfigError(f"sweep --slug '{slug}': letters, digits, '.', '_' or '-' only")
    root = Path(root)
    pattern = re.compile(r"\d{4}-\d{2}-\d{2}-" + re.escape(slug))
    found = sorted(p for p in root.glob(f"*-{slug}") if p.is_dir() and pattern.fullmatch(p.name))
    return found[-1] if found else root / f"{time.strftime('%Y-%m-%d')}-{slug}"


def _first_difference(old, new, prefix: str = "", *, added_ok: bool = False) -> str | None:
    """The first dotted key where two JSON values differ, with both values. `added_ok`: a key
    the old value lacks is no difference (a config key a newer rlhflab added, at its default)."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = set(old) if added_ok else set(old) | set(new)
        for k in sorted(keys, key=str):
            d = _first_difference(old.get(k), new.get(k), f"{prefix}{k}.", added_ok=added_ok)
            if d:
                return d
        return None
    if old != new:
        return f"{prefix.rstrip('.') or 'value'}: {json.dumps(old)} before, {json.dumps(new)} now"
    return None


def check_manifest(out: Path, manifest: dict) -> None:
    """Refuse to continue a campaign started with other settings (one line naming the first
    difference: a manifest field, or a key of the resolved config). A missing manifest: new."""
    path = out / MANIFEST
    if not path.is_file():
        return
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"sweep: {path} is unreadable ({exc}); move it away to start over"
        ) from None
    for field in (*_FIXED, "resolved_config"):
        if (
            field == "seeds"
            and isinstance(old.get("seeds"), int)
            and old["seeds"] <= manifest["seeds"]
        ):
            continue  # more seeds continue a campaign: its finished runs are kept
        # keys added to the config schema since the campaign began (at their defaults) are no
        # difference: an upgrade of rlhflab does not orphan a campaign
        d = _first_difference(old.get(field), manifest.get(field),
                              added_ok=field == "resolved_config")  # fmt: skip
        if d:
            where = "" if field == "resolved_config" else f"{field}."
            raise ConfigError(
                f"sweep: {out} was started with other settings ({where}{d}); use the original "
                "arguments, or another --slug for a new campaign"
            )


def _finished_run(runs: Path, name: str) -> Path | None:
    """The newest run directory of `name` under `runs` whose final_results.json says complete."""
    found = newest_complete_run(runs, name)
    return found[0] if found else None


@contextlib.contextmanager
def lock_campaign(out: Path, share: tuple[int, int] | None, *, report_only: bool):
    """Hold the lock of the campaign folder `out` (which must exist) for the `with` block
    (module doc): exclusive for a whole sweep, shared for `--report` and for an `--only i/N`
    share, which also holds its own `.lock-only-<i>-of-<N>` exclusively.

    Raises:
        ConfigError: another sweep holds it ("campaign folder <out> is in use by process <pid>
            (lock <file>); ..."), or the lock cannot be written.
    """
    what = f"campaign folder {out}"
    fds = [take_lock(out / LOCK, what, shared=report_only or share is not None)]
    try:
        if share is not None:
            fds.append(take_lock(out / f"{LOCK}-only-{share[0]}-of-{share[1]}", what))
        yield
    finally:
        for fd in fds:
            os.close(fd)


def run_sweep(
    config: str,
    *,
    grid_items: list[str],
    seeds: int = 3,
    overrides: list[str] | None = None,
    root: str = "experiments",
    slug: str | None = None,
    metric: str = HEADLINE,
    only: str | None = None,
    report_only: bool = False,
    resume: bool = False,
    baseline: str | None = None,
    ci: str = "t",
    question: str | None = None,
    until_ci_width: float | None = None,
    max_seeds: int | None = None,
    print_fn=None,
) -> dict:
    """Run (or continue, or only report) a sweep; see the module doc. The same arguments
    continue a campaign; `resume=True` (`--resume`) says so explicitly: it refuses when there is
    no campaign of this slug to continue, instead of starting one. More `seeds` than a campaign
    was started with add seeds to it (its finished runs are kept).

    `baseline`: the grid point (its label, e.g. "kl.coef=0") every other point is compared with,
    paired by seed (`paired_comparisons`); default the first. `ci`: that comparison's interval,
    "t" (Student t over the seeds) or "bootstrap" (percentile bootstrap over them). `question`: the README's question
    line. `until_ci_width` W with `max_seeds` K: after the `seeds` runs, add one seed at a time
    until every paired difference's 95% interval is narrower than W, or K seeds have run.

    Returns:
        {"out_dir", "ran", "skipped", "cells", "readme" (None with --only)}; with the report
        also "metric", "metric_name" and "points" ([{"label", "metric": {"mean", "se", "n"}}]).

    Raises:
        ConfigError: bad grid/seeds/only/slug, a config that does not validate for some cell
            (before any run starts), a campaign folder started with other settings, or one
            another sweep is writing (`lock_campaign`).
    """
    from rlhflab.config import load_config
    from rlhflab.next_steps import check_start_model

    if print_fn is None:  # progress lines go to stderr: stdout is the command's results
        print_fn = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if seeds < 1:
        raise ConfigError(f"sweep: --seeds must be >= 1 (got {seeds})")
    if (until_ci_width is None) != (max_seeds is None):
        raise ConfigError("sweep: --until-ci-width and --max-seeds go together")
    if until_ci_width is not None:
        if not until_ci_width > 0 or max_seeds < max(seeds, 2):
            raise ConfigError(
                f"sweep: --until-ci-width must be > 0 and --max-seeds >= max(--seeds, 2) (got "
                f"{until_ci_width}, {max_seeds})"
            )
        if only is not None or report_only:
            raise ConfigError(
                "sweep: --until-ci-width runs seeds until done; not with --only/--report"
            )
        kw = dict(grid_items=grid_items, overrides=overrides, root=root, slug=slug, metric=metric,
                  resume=resume, baseline=baseline, ci=ci, question=question,
                  print_fn=print_fn)  # fmt: skip
        n = seeds
        while True:
            summary = run_sweep(config, seeds=n, **kw)
            widths = [c["hi"] - c["lo"] for c in summary["comparisons"] if c["lo"] is not None]
            done = (
                n >= 2
                and len(widths) == len(summary["comparisons"])
                and all(w < until_ci_width for w in widths)
            )
            if done or n >= max_seeds:
                summary["until"] = {"ci_width": until_ci_width, "max_seeds": max_seeds,
                                    "seeds": n, "reached": done}  # fmt: skip
                (print_fn or (lambda line: print(line, file=sys.stderr)))(
                    f"sweep --until-ci-width {until_ci_width}: {n} seeds; every paired interval "
                    + (
                        "narrower"
                        if done
                        else f"NOT yet narrower (--max-seeds {max_seeds} reached)"
                    )
                )
                return summary
            n += 1
    overrides = list(overrides or [])
    grid = parse_grid(grid_items, config)
    share = parse_only(only)
    points = grid_points(grid)
    out = campaign_dir(root, slug or _slug_default(config, grid))
    runs = out / "runs"
    cells = [(i, p, s, cell_name(i, p, s)) for i, p in enumerate(points) for s in range(seeds)]

    # Every cell's config validates before the first (long) run starts.
    def cell_overrides(p, s, name):
        return [*overrides, *(f"{k}={v}" for k, v in p.items()), f"seed={s}",
                f"run.root={runs}", f"run.name={name}"]  # fmt: skip

    cfgs = {c[3]: load_config(config, cell_overrides(c[1], c[2], c[3])) for c in cells}
    first = cfgs[cells[0][3]].model_dump(mode="json")
    for k in ("seed", "run"):
        first.pop(k, None)
    manifest = {
        "config": str(config),
        "overrides": overrides,
        "grid": grid,
        "seeds": seeds,
        "metric": metric,
        "resolved_config": first,
    }
    if resume and not (out / MANIFEST).is_file():
        raise ConfigError(
            f"sweep --resume: no campaign '{out.name[11:]}' under {out.parent} to continue "
            f"(no {MANIFEST}); leave out --resume to start it"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"sweep: cannot create {out}: {exc.strerror or exc}") from None
    labels = [point_label(p) for p in points]
    if baseline is not None and baseline not in labels:  # before any (long) run
        raise ConfigError(f"sweep: --baseline {baseline!r} is not a grid point; the points are "
                          f"{', '.join(repr(x) for x in labels)}")  # fmt: skip
    with lock_campaign(out, share, report_only=report_only):  # before anything is read or written
        check_manifest(out, manifest)
        if question is None and (out / MANIFEST).is_file():  # a continued campaign keeps its own
            question = json.loads((out / MANIFEST).read_text()).get("question")
        manifest["question"] = question
        write_json_atomic(out / MANIFEST, manifest)
        if not (out / ".gitignore").exists():
            write_text_atomic(out / ".gitignore", "runs/\n.lock*\n")
        ran, skipped = [], []
        if not report_only:
            from rlhflab.trainers import run_config

            check_start_model(cfgs[cells[0][3]])
            mine = [c for j, c in enumerate(cells) if share is None or j % share[1] == share[0]]
            for k, (_, p, s, name) in enumerate(mine, 1):
                if _finished_run(runs, name) is not None:
                    skipped.append(name)
                    print_fn(f"sweep [{k}/{len(mine)}] {name}: finished, skipped")
                    continue
                print_fn(f"sweep [{k}/{len(mine)}] {name}: {point_label(p)}, seed {s}")
                run_config(load_config(config, [*cell_overrides(p, s, name), "run.resume=auto"]))
                ran.append(name)
        summary: dict = {"out_dir": str(out), "ran": ran, "skipped": skipped, "cells": len(cells),
                         "readme": None}  # fmt: skip
        if share is None:
            results = gather(out, manifest, cells, baseline=baseline, ci=ci)
            results["question"] = question
            write_json_atomic(out / "results.json", results)
            plot_sweep(results, out)
            readme = out / "README.md"
            write_text_atomic(readme, render_readme(results, out))
            summary.update(readme=str(readme), metric=metric, metric_name=results["metric_name"],
                           points=[{"label": pt["label"], "metric": pt["metric"]}
                                   for pt in results["points"]],
                           baseline=results["baseline"], comparisons=results["comparisons"],
                           conclusion=results["conclusion"])  # fmt: skip
        else:
            print_fn(f"sweep: share {only} done; gather with the same command and --report")
        return summary


def _tail_mean(rows: list[dict], key: str) -> float | None:
    vals = [v for _, _, v in metric_series(rows, key)][-_TAIL:]
    return statistics.mean(vals) if vals else None


def _stat(values: list[float | None]) -> dict:
    """{"mean", "se", "n"} of the values present (se None below 2 values)."""
    vals = [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]
    if not vals:
        return {"mean": None, "se": None, "n": 0}
    mean, se = mean_and_stderr(vals)
    return {"mean": mean, "se": None if math.isnan(se) else se, "n": len(vals)}


def _curve(rows_per_seed: list[list[dict]], key: str) -> list[tuple[int, float, float]]:
    """(step, mean, s.e.) at the steps every seed logged `key` (s.e. 0 with one seed)."""
    series = [{s: v for s, _, v in metric_series(rows, key)} for rows in rows_per_seed]
    series = [s for s in series if s]
    if not series:
        return []
    steps = sorted(set.intersection(*[set(s) for s in series]))
    out = []
    for step in steps:
        mean, se = mean_and_stderr([s[step] for s in series])
        out.append((step, mean, 0.0 if math.isnan(se) else se))
    return out


def run_metric(result: dict, metric: str) -> tuple[str | None, float | None, float | None]:
    """(name, value, value before training) of one run's `metric` in its final_results.json.

    `metric == "headline"`: the run's named held-out headline (`{"name", "value", "before"}`,
    e.g. name "correctness (task verifier)"); a run from before the headline existed falls back
    to `heldout_accuracy` / `heldout_accuracy_before` (named after its `heldout_metric`). Any
    other key: its value, `<key>_before`, and the run's `heldout_metric` as the name."""
    if metric == HEADLINE:
        h = result.get(HEADLINE)
        if isinstance(h, dict):
            return h.get("name"), h.get("value"), h.get("before")
        return (
            "heldout_accuracy",
            result.get("heldout_accuracy"),
            result.get("heldout_accuracy_before"),
        )
    return result.get("heldout_metric"), result.get(metric), result.get(f"{metric}_before")


def run_kl_key(rows: list[dict]) -> str:
    """`policy/kl_ref` when the run logged it (the KL to the reference or initial policy, β ≥ 0),
    else `policy/kl` (logged only with a KL term, β > 0)."""
    return _KL_REF if metric_series(rows, _KL_REF) else _KL


def _eval_key(rows_per_seed: list[list[dict]], metric: str) -> str:
    """The logged held-out curve: `eval/headline` when the headline is tabulated and logged."""
    if metric == HEADLINE and all(metric_series(r, "eval/headline") for r in rows_per_seed):
        return "eval/headline"
    return "eval/accuracy"


def gather(out: Path, manifest: dict, cells: list, *, baseline: str | None = None,
           ci: str = "t") -> dict:  # fmt: skip
    """Per run and per grid point: the headline metric (final and before training), KL and
    rollout reward over the last logged steps, wall-clock; curves over steps (mean ± s.e.); and
    every point against the `baseline` point (its label; default the first), paired by seed
    (`paired_comparisons`), with the conclusion line they support.

    Raises:
        ConfigError: `baseline` is not a grid point's label (names the labels)."""
    metric = manifest["metric"]
    points: list[dict] = []
    by_point: dict[int, list] = {}
    for i, p, s, name in cells:
        by_point.setdefault(i, [p, []])[1].append((s, name))
    metric_name, kl_keys = None, set()
    for p, members in by_point.values():
        per_run, rows_all = [], []
        for s, name in members:
            d = _finished_run(out / "runs", name)
            if d is None:
                continue
            res = json.loads((d / "final_results.json").read_text())
            rows = read_metrics(d / "metrics.jsonl")
            rows_all.append(rows)
            name_, value, before = run_metric(res, metric)
            metric_name = metric_name or name_
            kl_key = run_kl_key(rows)
            kl_keys.add(kl_key)
            per_run.append({
                "seed": s,
                "run_dir": str(d.relative_to(out)),
                "metric": value,
                "metric_before": before,
                "kl_key": kl_key,
                "kl_last10": _tail_mean(rows, kl_key),
                "reward_last10": _tail_mean(rows, _REWARD),
                "wall_s": res.get("wall_s"),
                "steps": res.get("steps"),
                "heldout_n": res.get("heldout_n"),
            })  # fmt: skip
        points.append({
            "point": p,
            "label": point_label(p),
            "runs": per_run,
            "seeds_done": len(per_run),
            "metric": _stat([r["metric"] for r in per_run]),
            "metric_before": _stat([r["metric_before"] for r in per_run]),
            "kl_last10": _stat([r["kl_last10"] for r in per_run]),
            "reward_last10": _stat([r["reward_last10"] for r in per_run]),
            "wall_s": _stat([r["wall_s"] for r in per_run]),
            "curves": {
                "eval": _curve(rows_all, _eval_key(rows_all, metric)),
                "reward": _curve(rows_all, _REWARD),
                "kl": _curve(rows_all, _KL_REF if _KL_REF in kl_keys else _KL),
            },
        })  # fmt: skip
    labels = [pt["label"] for pt in points]
    if baseline is not None and baseline not in labels:
        raise ConfigError(f"sweep: --baseline {baseline!r} is not a grid point; the points are "
                          f"{', '.join(repr(x) for x in labels)}")  # fmt: skip
    base = labels.index(baseline) if baseline is not None else 0
    comparisons = _sweep_comparisons(points, base, ci)
    return {
        "config": manifest["config"],
        "overrides": manifest["overrides"],
        "grid": manifest["grid"],
        "seeds": manifest["seeds"],
        "metric": metric,
        "metric_name": metric_name,
        "kl_key": _KL_REF if _KL_REF in kl_keys else _KL,
        "points": points,
        "baseline": labels[base] if labels else None,
        "ci": ci,
        "comparisons": comparisons,
        "conclusion": conclusion_line(comparisons, labels[base] if labels else None),
    }


def _sweep_comparisons(points: list[dict], base: int, ci: str = "t") -> list[dict]:
    """`compare.paired_comparisons` of the grid points' per-seed metrics against point `base`."""
    arms = {pt["label"]: {r["seed"]: r["metric"] for r in pt["runs"]} for pt in points}
    return paired_comparisons(arms, points[base]["label"], ci=ci) if points else []


def fmt_stat(stat: dict, digits: int = 3) -> str:
    """ "0.512 ± 0.013 (3)" — mean ± standard error (number of seeds); "–" when empty; the mean
    alone with one seed."""
    if not stat["n"]:
        return "–"
    if stat["se"] is None:
        return f"{stat['mean']:.{digits}f} (1)"
    return f"{stat['mean']:.{digits}f} ± {stat['se']:.{digits}f} ({stat['n']})"


def sweep_table(results: dict) -> str:
    """The markdown table: one row per grid point, mean ± s.e. over seeds."""
    m = results["metric"]
    if m == HEADLINE and results.get("metric_name"):
        m = f"{results['metric_name']}"
    kl = results.get("kl_key", _KL)
    head = (
        f"| grid point | {m} (final) | {m}, before | {kl} (per token), last {_TAIL} steps "
        f"| rollout reward, last {_TAIL} steps | wall-clock s / run | seeds |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for pt in results["points"]:
        lines.append(
            f"| {pt['label']} | {fmt_stat(pt['metric'])} | {fmt_stat(pt['metric_before'])} | "
            f"{fmt_stat(pt['kl_last10'], 4)} | {fmt_stat(pt['reward_last10'])} | "
            f"{fmt_stat(pt['wall_s'], 0)} | {pt['seeds_done']}/{results['seeds']} |"
        )
    return "\n".join(lines) + "\n"


def render_readme(results: dict, out: Path) -> str:
    """The campaign's README.md (see module doc)."""
    grid_args = " ".join(f"--grid {k}={','.join(v)}" for k, v in results["grid"].items())
    cmd = (
        f"rlhflab sweep {results['config']} {grid_args} --seeds {results['seeds']} "
        f"--root {out.parent} --slug {out.name[11:]} {' '.join(results['overrides'])}"
    ).strip()
    name = results.get("metric_name")
    if results["metric"] == HEADLINE:
        metric_doc = (
            "each run's held-out headline (`headline` of final_results.json"
            + (f": {name}" if name else "")
            + "; `heldout_accuracy` for runs from before it existed), greedy, on the task's "
            "held-out problems"
        )
    else:
        metric_doc = f"`{results['metric']}` of each run's final_results.json" + (
            f" (held-out {name}: greedy, on the task's held-out problems)" if name else ""
        )
    n_runs = sum(pt["seeds_done"] for pt in results["points"])
    total = len(results["points"]) * results["seeds"]
    kl_note = (
        f"KL is `{results.get('kl_key', _KL)}` of metrics.jsonl: the k3 estimate of KL(π‖π_ref) "
        "per completion token, mean of each run's last 10 logged values (`policy/kl_ref` when the "
        "run logged it — with β > 0, or β = 0 for LoRA or `kl.track_initial` — else `policy/kl`, "
        "logged only with a KL term; – when it logged neither)."
    )
    return "\n".join([
        f"# Sweep {out.name}",
        "",
        "Question: " + (results.get("question") or "_(write the question this campaign answers)_"),
        "",
        "## Configs",
        "",
        f"- Config: `{results['config']}`",
        f"- Fixed overrides: `{' '.join(results['overrides']) or 'none'}`",
        "- Grid: " + "; ".join(f"`{k}` ∈ {{{', '.join(v)}}}" for k, v in results["grid"].items()),
        f"- Seeds: 0..{results['seeds'] - 1} (`seed=i`); runs finished: {n_runs}/{total}",
        f"- Command (resumable: run it again to continue): `{cmd}`",
        "- Every run's resolved config: `runs/<cell>-<timestamp>/config.yaml` (not in git)",
        "",
        "## Results",
        "",
        sweep_table(results),
        f"Mean ± standard error over seeds (number of seeds). Headline: {metric_doc}. "
        f"{kl_note} Wall-clock is per run, on a shared machine.",
        "",
        f"![{results['metric']} against the grid](metric_vs_grid.png)",
        "",
        "![curves over steps](curves.png)",
        "",
        f"## Against {results['baseline']}, paired by seed",
        "",
        paired_table(results["comparisons"], results["baseline"], "grid point"),
        "Each grid point's runs minus the baseline's, seed by seed (seed i of every point sees "
        "the same data order, initial weights and sampling noise): the mean difference with its "
        + ("95% Student t interval over the paired seeds"
           if results.get("ci", "t") == "t" else
           "95% percentile-bootstrap interval over the paired seeds (2,000 resamples)")
        + "; beside it the unpaired (Welch) interval "
        "of the same runs' means, as if the seeds were unrelated, and the ratio of the two "
        "widths; the paired seeds a difference of the observed size needs to be resolved 80% of "
        "the time at the observed paired s.d. (`rlhflab.stats`).",
        "",
        "Numbers per run and per grid point: `results.json`.",
        "",
        f"Conclusion: {results['conclusion']} (Computed from the paired intervals above.)",
        "",
    ])  # fmt: skip


def _as_number(values: list[str]) -> list[float] | None:
    try:
        return [float(v) for v in values]
    except ValueError:
        return None


def plot_sweep(results: dict, out: Path) -> None:
    """metric_vs_grid.png (error bars ± s.e.; first grid key on x, one line per combination of the
    others) and curves.png (held-out metric, rollout reward, KL against step; mean ± s.e. bands)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results["grid"])
    xkey, xvals = keys[0], results["grid"][keys[0]]
    numeric = _as_number(xvals)
    lines: dict[str, list] = {}
    for pt in results["points"]:
        rest = point_label({k: v for k, v in pt["point"].items() if k != xkey}) or results["metric"]
        lines.setdefault(rest, []).append(pt)
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for label, pts in lines.items():
        xs, ys, es = [], [], []
        for pt in pts:
            if pt["metric"]["n"]:
                v = pt["point"][xkey]
                xs.append(numeric[xvals.index(v)] if numeric else xvals.index(v))
                ys.append(pt["metric"]["mean"])
                es.append(pt["metric"]["se"] or 0.0)
        if xs:
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=4, label=label)
    if not numeric:
        ax.set_xticks(range(len(xvals)), xvals)
    ax.set_xlabel(xkey)
    head_name = results.get("metric_name") if results["metric"] == HEADLINE else None
    ax.set_ylabel(f"{head_name or results['metric']} (mean ± s.e. over seeds)")
    ax.grid(alpha=0.3)
    if len(lines) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "metric_vs_grid.png")
    plt.close(fig)

    head = results.get("metric_name") if results["metric"] == HEADLINE else None
    panels = [
        ("eval", f"held-out {head}" if head else "eval/accuracy (held-out)"),
        ("reward", _REWARD),
        ("kl", results.get("kl_key", _KL)),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4), dpi=100)
    cmap = plt.get_cmap("tab10" if len(results["points"]) <= 10 else "tab20")
    for i, pt in enumerate(results["points"]):
        for ax, (key, _) in zip(axes, panels, strict=True):
            curve = pt["curves"][key]
            if not curve:
                continue
            steps, mean, se = zip(*curve, strict=True)
            lo = [m - e for m, e in zip(mean, se, strict=True)]
            hi = [m + e for m, e in zip(mean, se, strict=True)]
            color = cmap(i % cmap.N)
            ax.plot(
                steps,
                mean,
                color=color,
                label=pt["label"],
                marker="o" if len(steps) < 15 else None,
                ms=3,
            )
            ax.fill_between(steps, lo, hi, color=color, alpha=0.15)
    for ax, (_, title) in zip(axes, panels, strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    labelled = [ax for ax in axes if ax.get_lines()]
    if labelled:
        labelled[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "curves.png")
    plt.close(fig)

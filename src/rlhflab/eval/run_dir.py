"""`rlhflab eval RUN_DIR --passk | --checkpoints`: evaluate the models of a finished (or stopped)
policy-gradient run on its own held-out set, rebuilt from the run's config.yaml.

    --passk        the initial model (`model.name_or_path`) and the final model (`RUN_DIR/model`):
                   pass@k and maj@k for every k (Chen et al. 2021; Wang et al. 2022), written to
                   RUN_DIR/eval/passk.json and passk.png (pass@k against k, before vs after: the
                   "does RL only sharpen the distribution?" question of Yue et al. 2025, arXiv
                   2504.13837 — pass@1 rising while pass@k at large k falls is sharpening)
    --checkpoints  the initial model, every committed checkpoint and the final model: the
                   headline (greedy) against the step, RUN_DIR/eval/checkpoints.json and .png;
                   with --benchmark NAME, a named benchmark protocol on each of them instead
                   (RUN_DIR/eval/benchmark_<name>.json, `benchmark_curve`)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from rlhflab.errors import ConfigError


def is_run_dir(path: str) -> bool:
    """Whether `path` is a run directory (a folder holding config.yaml and metrics.jsonl)."""
    p = Path(path)
    return p.is_dir() and (p / "config.yaml").is_file() and (p / "metrics.jsonl").is_file()


def run_heldout(run_dir: str | Path) -> dict:
    """The held-out set and scorer of a policy-gradient run, as its trainer built them.

    Returns:
        {"cfg", "rows" (held-out problems or prompt rows, the first eval.n), "scorer" (the task
        Verifier or the prompt dataset's TextRewardScorer), "system", "instruction", "env" (the
        run's `env` section: its held-out set is evaluated by episodes; None without one)}.
    Raises:
        ConfigError: the run is not a policy-gradient run, or has no held-out set.
    """
    from rlhflab.config import load_config
    from rlhflab.data.formatting import task_instruction
    from rlhflab.data.prompts import load_prompt_source
    from rlhflab.rewards.shaping import TextRewardScorer
    from rlhflab.rewards.verifier import Verifier

    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    if cfg.trainer != "policy_gradient":
        raise ConfigError(
            f"eval {run_dir}: --passk and --checkpoints evaluate policy_gradient runs (this run "
            f"is '{cfg.trainer}'); evaluate its model with --task or --data"
        )
    t = cfg.task
    splits = load_prompt_source(cfg.data, t, seed=cfg.seed)
    verifier = Verifier(answer_format=t.answer_format, reward=t.reward, extractor=t.extractor)
    task = cfg.data.source == "task"
    scorer = verifier if task else TextRewardScorer(cfg.reward.components)
    rows = splits.heldout[: cfg.eval.n]
    if not rows or (not task and not scorer.reported):
        raise ConfigError(f"eval {run_dir}: the run has no held-out set to evaluate (eval.n 0)")
    return {
        "cfg": cfg,
        "rows": rows,
        "scorer": scorer,
        "system": t.system if task else cfg.data.system,
        "instruction": task_instruction(t) if task else None,
        "env": cfg.env,
    }


def initial_model(cfg, run_dir: Path) -> str:
    """The run's starting model (`model.name_or_path`). Raises ConfigError for a model built
    from scratch (`model.build`: its initial weights were never saved)."""
    if cfg.model.name_or_path is None:
        raise ConfigError(
            f"eval {run_dir}: the run built its model from scratch (model.build), so its initial "
            "weights were not saved; evaluate checkpoints with --checkpoints"
        )
    return cfg.model.name_or_path


def _evaluate(path: str, held: dict, *, ks, n_samples, temperature, max_new_tokens, batch_size,
              seed, engine) -> dict:  # fmt: skip
    from rlhflab.eval.common import load_and_evaluate

    if held["env"] is not None:  # greedy episodes with the run's environment, as it evaluated
        from rlhflab.eval.episodes import load_and_run_episodes

        res = load_and_run_episodes(
            path, held["rows"], held["env"], engine=engine, batch_size=batch_size,
            rollout_max_new_tokens=held["cfg"].rollout.max_new_tokens,
        )  # fmt: skip
        return {"model": path, **res}
    res = load_and_evaluate(
        path,
        held["rows"],
        held["scorer"],
        engine=engine,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        k=list(ks) if ks else 0,
        n_samples=n_samples,
        temperature=temperature,
        seed=seed,
        system=held["system"],
        instruction=held["instruction"],
    )
    return {"model": path, **res}


def passk_before_after(
    run_dir: str | Path,
    *,
    ks: list[int],
    n_samples: int = 0,
    temperature: float | None = None,
    max_new_tokens: int | None = None,
    batch_size: int | None = None,
    engine: str = "hf",
    print_fn=print,
) -> dict:
    """pass@k and maj@k of the run's initial and final models on its held-out set, for each k
    in `ks` from `n_samples` (default max(ks)) samples per problem; temperature, max_new_tokens
    and batch_size default to the run's `eval` section. Writes RUN_DIR/eval/passk.json and
    passk.png; returns {"before", "after", "ks", "n_samples", "json", "png"}.
    Raises ConfigError (no final model, model built from scratch, not a PG run)."""
    run_dir = Path(run_dir)
    held = run_heldout(run_dir)
    cfg = held["cfg"]
    if held["env"] is not None:
        raise ConfigError(
            f"eval {run_dir} --passk: the run has an environment ({held['env'].class_}); its "
            "held-out evaluation is greedy episodes (--checkpoints), pass@k of episodes is not "
            "implemented"
        )
    final = run_dir / "model"
    if not final.is_dir():
        raise ConfigError(f"eval {run_dir}: no final model ({final}); the run did not finish")
    kw = dict(
        ks=sorted(set(ks)),
        n_samples=n_samples or max(ks),
        temperature=temperature or cfg.eval.temperature,
        max_new_tokens=max_new_tokens or cfg.eval.max_new_tokens,
        batch_size=batch_size or cfg.eval.batch_size,
        seed=cfg.seed,
        engine=engine,
    )
    out = {"ks": kw["ks"], "n_samples": kw["n_samples"], "n": len(held["rows"])}
    for label, path in (("before", initial_model(cfg, run_dir)), ("after", str(final))):
        out[label] = _evaluate(path, held, **kw)
        print_fn(f"{label}: " + _passk_line(out[label], kw["ks"]))
    folder = run_dir / "eval"
    folder.mkdir(exist_ok=True)
    out["json"], out["png"] = str(folder / "passk.json"), str(folder / "passk.png")
    Path(out["json"]).write_text(json.dumps(out, indent=2, default=str) + "\n")
    plot_passk(out, Path(out["png"]))
    return out


def _passk_line(res: dict, ks: list[int]) -> str:
    parts = [f"{res['headline_name']} {res['headline']:.3f}"]
    parts += [f"pass@{k} {res[f'pass@{k}']:.3f}" for k in ks if f"pass@{k}" in res]
    parts += [f"maj@{k} {res[f'maj@{k}']:.3f}" for k in ks if f"maj@{k}" in res]
    return ", ".join(parts)


def plot_passk(out: dict, path: Path) -> None:
    """pass@k (solid) and maj@k (dashed) against k (log2 axis), before and after training, with
    ±1 standard error bars (over problems)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4), dpi=100)
    for label, color in (("before", "tab:gray"), ("after", "tab:blue")):
        res = out[label]
        for metric, style in (("pass", "-"), ("maj", "--")):
            ks = [k for k in out["ks"] if _finite(res.get(f"{metric}@{k}"))]
            if not ks:
                continue
            ys = [res[f"{metric}@{k}"] for k in ks]
            es = [res.get(f"{metric}@{k}_stderr") or 0.0 for k in ks]
            es = [e if _finite(e) else 0.0 for e in es]
            ax.errorbar(ks, ys, yerr=es, ls=style, marker="o", ms=3, color=color, capsize=2,
                        label=f"{metric}@k {label} training")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("held-out")
    ax.set_title(f"pass@k / maj@k (n = {out['n_samples']} samples, {out['n']} problems)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def checkpoint_curve(
    run_dir: str | Path,
    *,
    max_new_tokens: int | None = None,
    batch_size: int | None = None,
    engine: str = "hf",
    print_fn=print,
) -> dict:
    """The held-out headline (greedy) of the initial model (when saved), every committed
    checkpoint of the run and its final model, against the step. Writes
    RUN_DIR/eval/checkpoints.json ({"headline_name", "points": [{"step", "model", "headline",
    "headline_stderr", "reward/<name>"...}], "pruned_steps" (checkpoints deleted by
    checkpoint.keep_last), "logged" (the run's own evaluations, `logged_evals`), "note"}) and
    checkpoints.png; the note (why the curve has few points) is printed and drawn too.
    Raises ConfigError: not a PG run, nothing to evaluate, or a sharded (fsdp2) checkpoint,
    which is not a `from_pretrained` directory."""
    run_dir = Path(run_dir)
    held = run_heldout(run_dir)
    cfg = held["cfg"]
    models = saved_models(run_dir, cfg)
    kw = dict(
        ks=[],
        n_samples=0,
        temperature=cfg.eval.temperature,
        max_new_tokens=max_new_tokens or cfg.eval.max_new_tokens,
        batch_size=batch_size or cfg.eval.batch_size,
        seed=cfg.seed,
        engine=engine,
    )
    points = []
    for step, path in models:
        res = _evaluate(path, held, **kw)
        point = {"step": step, **res}
        points.append(point)
        print_fn(f"step {step}: {res['headline_name']} {res['headline']:.3f} ({path})")
    folder = run_dir / "eval"
    folder.mkdir(exist_ok=True)
    last = max(s for s, _ in models)
    kept = [s for s, _ in models if s > 0]
    out = {
        "headline_name": points[0]["headline_name"],
        "n": len(held["rows"]),
        "points": points,
        "pruned_steps": pruned_steps(cfg, last, kept),
        "logged": logged_evals(run_dir),
    }
    out["note"] = curve_note(cfg, out)
    if out["note"]:
        print_fn(f"note: {out['note']}")
    out["json"], out["png"] = str(folder / "checkpoints.json"), str(folder / "checkpoints.png")
    Path(out["json"]).write_text(json.dumps(out, indent=2, default=str) + "\n")
    plot_checkpoints(out, Path(out["png"]))
    return out


def saved_models(run_dir: Path, cfg) -> list[tuple[int, str]]:
    """[(step, model path)] of a run: its initial model (`model.name_or_path`, step 0, when not
    built from scratch), every committed checkpoint and its final model (`RUN_DIR/model`, at
    final_results.json's `steps`, unless a checkpoint has that step).
    Raises ConfigError: none at all, or a sharded (fsdp2) checkpoint, which is not a
    `from_pretrained` directory."""
    from rlhflab.checkpoint.format import committed_checkpoints, step_of

    models: list[tuple[int, str]] = []
    if cfg.model.name_or_path is not None:
        models.append((0, cfg.model.name_or_path))
    for ckpt in committed_checkpoints(run_dir):
        if list(ckpt.glob("*.shards.json")):
            raise ConfigError(
                f"eval {run_dir}: checkpoint {ckpt.name} is sharded (fsdp2); consolidate it "
                "with rlhflab.checkpoint.read_tensors first"
            )
        models.append((step_of(ckpt), str(ckpt)))
    final = run_dir / "model"
    results = run_dir / "final_results.json"
    if final.is_dir() and results.is_file():
        steps = json.loads(results.read_text()).get("steps")
        if isinstance(steps, int) and all(s != steps for s, _ in models):
            models.append((steps, str(final)))
    if not models:
        raise ConfigError(f"eval {run_dir}: no saved model or committed checkpoint to evaluate")
    return models


def benchmark_curve(run_dir: str | Path, name: str, *, path: str | None = None,
                    print_fn=print, **kw) -> dict:  # fmt: skip
    """Benchmark `name` (`rlhflab.eval.benchmarks`) on every saved model of a run (any trainer):
    the initial model, each committed checkpoint and the final model (`saved_models`), with the
    same protocol, file and departures for each. Writes RUN_DIR/eval/benchmark_<name>.json.

    Args:
        kw: `run_benchmark`'s keywords (n_samples, max_new_tokens, ks, limit, batch_size, seed,
            engine).
    Returns:
        {"benchmark", "file", "headline_name", "n", "points": [{"step", **run_benchmark's
        result}], "json", "lines" (a table: step, headline ± stderr, model)}.
    Raises:
        ConfigError / DataError: as `saved_models` and `run_benchmark` (the file is read once,
        before any model is loaded).
    """
    from rlhflab.config import load_config
    from rlhflab.eval.benchmarks import benchmark_path, load_benchmark, run_benchmark

    run_dir = Path(run_dir)
    file = str(benchmark_path(name, path))
    items = load_benchmark(name, file)
    models = saved_models(run_dir, load_config(run_dir / "config.yaml"))
    points = []
    for step, model in models:
        res = run_benchmark(model, name, path=file, items=items, **kw)
        points.append({"step": step, **res})
        print_fn(f"step {step}: {name} {res['headline_name']} {res['headline']:.3f} ({model})")
    first = points[0]
    lines = [
        f"{name} over the run's saved models ({first['n']} problems, {first['headline_name']}):"
    ]
    for p in points:
        se = p["headline_stderr"]
        se_text = f" ± {se:.3f}" if se == se else ""
        lines.append(f"  step {p['step']:>6}: {p['headline']:.3f}{se_text}  ({p['model']})")
    lines += [f"departure from the protocol: {d}" for d in first["departures"]]
    folder = run_dir / "eval"
    folder.mkdir(exist_ok=True)
    out = {"benchmark": name, "file": file, "headline_name": first["headline_name"],
           "n": first["n"], "points": points, "json": str(folder / f"benchmark_{name}.json")}  # fmt: skip
    Path(out["json"]).write_text(json.dumps(out, indent=2, default=str) + "\n")
    out["lines"] = [*lines, f"wrote {out['json']}"]
    return out


def pruned_steps(cfg, last: int, kept: list[int]) -> list[int]:
    """The steps whose checkpoint the run wrote and then deleted (`checkpoint.keep_last`): every
    multiple of `checkpoint.every` up to `last` (the run's last step), minus the steps still
    evaluated (`kept`: committed checkpoints and the final model). Empty when every checkpoint
    was kept or none was written (`every` 0)."""
    every = cfg.checkpoint.every
    if not every or cfg.checkpoint.keep_last is None:
        return []
    return [s for s in range(every, last + 1, every) if s not in set(kept)]


def logged_evals(run_dir: Path) -> list[dict]:
    """The run's own held-out evaluations from metrics.jsonl, [{"step", "headline",
    "headline_stderr"}] (the headline, or for episodes the success rate `eval/accuracy`): the
    same rows, prompts and greedy decoding as a checkpoint's re-evaluation, at every
    `eval.every` step, whether or not its checkpoint was kept."""
    from rlhflab.tracking import read_metrics

    path = run_dir / "metrics.jsonl"
    out = {}
    for row in read_metrics(path) if path.is_file() else []:
        key = "eval/headline" if "eval/headline" in row else "eval/accuracy"
        if isinstance(row.get(key), int | float) and isinstance(row.get("step"), int):
            se = row.get(f"{key}_stderr")
            out[row["step"]] = {"step": row["step"], "headline": row[key], "headline_stderr": se}
    return [out[s] for s in sorted(out)]  # a resumed run's repeated step: its last row


def curve_note(cfg, out: dict) -> str | None:
    """The line that says why the curve has few points (deleted checkpoints) and what stands in
    for them (the run's logged evaluations), or None when no checkpoint was deleted."""
    pruned = out["pruned_steps"]
    if not pruned:
        return None
    kept = len([p for p in out["points"] if p["step"] > 0])
    shown = ", ".join(map(str, pruned[:3])) + (f", … {pruned[-1]}" if len(pruned) > 3 else "")
    logged = [r["step"] for r in out["logged"]]
    note = (
        f"{len(pruned)} checkpoints (steps {shown}) were deleted during the run "
        f"(checkpoint.keep_last {cfg.checkpoint.keep_last}): {kept} saved models are evaluated"
    )
    if logged:
        note += (
            f"; the run's own held-out evaluations ({len(logged)}, metrics.jsonl) are drawn hollow"
        )
    return note + "; keep every checkpoint with checkpoint.keep_last: null"


def plot_checkpoints(out: dict, path: Path) -> None:
    """The headline (±1 standard error) and each reward component against the step; the run's
    own logged evaluations (`logged`) as hollow markers, and `note` (deleted checkpoints)
    under the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = out["points"]
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    steps = [p["step"] for p in pts]
    ys = [p["headline"] for p in pts]
    es = [p.get("headline_stderr") if _finite(p.get("headline_stderr")) else 0.0 for p in pts]
    ax.errorbar(steps, ys, yerr=es, marker="o", ms=3, capsize=2, label=out["headline_name"])
    names = sorted({k for p in pts for k in p if k.startswith("reward/")} - {"reward/"})
    for key in (k for k in names if not k.endswith("_stderr")):
        ax.plot(steps, [p.get(key) for p in pts], ls="--", marker=".", label=key)
    logged = out.get("logged") or []
    if logged and out.get("pruned_steps"):
        ax.plot([r["step"] for r in logged], [r["headline"] for r in logged], ls=":", marker="o",
                ms=4, mfc="none", color="tab:gray", label="logged during the run (metrics.jsonl)")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_title(f"held-out, saved checkpoints ({out['n']} problems)")
    if out.get("note"):
        kept = len([p for p in pts if p["step"] > 0])
        ax.text(0.01, 0.01, f"{len(out['pruned_steps'])} checkpoints deleted by "
                f"checkpoint.keep_last; {kept} kept", transform=ax.transAxes, fontsize=7,
                va="bottom", color="tab:red")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

"""The few lines `rlhflab train` prints when a run ends; the full results stay in the run's
final_results.json.

    sft finished: 130 steps in 0:01:35, final loss 0.605
    held-out accuracy: 46.0% ± 3.5 (n=200; before training 0.0%; majority-answer baseline 2.0%)
    health: all 7 checks passed
    run directory: runs/sft-20261126-011741 (final_results.json, metrics.jsonl, plots/, model/)
"""

from __future__ import annotations

import math
from typing import Any


def _num(x: Any) -> float | None:
    """A finite float, or None (missing, null, NaN)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


def duration(seconds: float) -> str:
    """`H:MM:SS` of a number of seconds (rounded)."""
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _heldout_line(r: dict) -> str | None:
    """The held-out headline ± standard error: task accuracy ("held-out accuracy"), a prompt
    dataset's correctness reward ("held-out correctness (math_verify)") or, without one, its
    named weighted reward ("held-out reward (weighted sum: ...)")."""
    h = r.get("headline") if isinstance(r.get("headline"), dict) else None
    if h is not None:
        name, acc, se, before = h.get("name") or "", _num(h.get("value")), h.get("stderr"), None
        before = _num(h.get("before"))
        is_acc = name.startswith("correctness")
        label = "accuracy" if name == "correctness (task verifier)" else name
    else:  # results written before the headline existed
        acc, se = _num(r.get("heldout_accuracy")), r.get("heldout_accuracy_stderr")
        before = _num(r.get("heldout_accuracy_before"))
        is_acc = r.get("heldout_metric", "accuracy") == "accuracy"
        label = "accuracy" if is_acc else "mean reward"
    if acc is None:
        return None

    def show(v: float) -> str:
        return f"{100 * v:.1f}%" if is_acc else f"{v:.3f}"

    se = _num(se)
    text = f"held-out {label}: {show(acc)}"
    if se is not None:
        text += f" ± {100 * se:.1f}" if is_acc else f" ± {se:.3f}"
    extra = [f"n={r['heldout_n']}"] if r.get("heldout_n") else []
    if before is not None:
        extra.append(f"before training {show(before)}")
    base = _num(r.get("heldout_majority_baseline"))
    if base is not None:
        extra.append(f"majority-answer baseline {show(base)}")
    return text + (f" ({'; '.join(extra)})" if extra else "")


def _components_line(r: dict) -> str | None:
    """Every held-out reward component on its own, and their weighted sum (prompt datasets)."""
    parts = r.get("heldout_rewards")
    if not isinstance(parts, dict) or not parts:
        return None
    shown = [f"{k} {_num(v):.3f}" for k, v in parts.items() if _num(v) is not None]
    total = _num(r.get("heldout_reward"))
    tail = f" (weighted sum {total:.3f})" if total is not None else ""
    return f"held-out reward components: {', '.join(shown)}{tail}" if shown else None


def _other_eval_lines(r: dict) -> list[str]:
    """Direct alignment's held-out preference accuracy; a reward model's held-out metrics."""
    lines = []
    pref = _num(r.get("heldout_pref_accuracy"))
    if pref is not None:
        before = _num(r.get("heldout_pref_accuracy_before"))
        tail = f"; before training {100 * before:.1f}%" if before is not None else ""
        n = r.get("heldout_pref_n")
        lines.append(f"held-out preference accuracy: {100 * pref:.1f}% (n={n}{tail})")
    ev = r.get("eval")
    if r.get("trainer") == "reward_model" and isinstance(ev, dict):
        keys = ("accuracy", "auc", "step_accuracy", "solution_auc", "ece")
        shown = [f"{k} {_num(ev[k]):.3f}" for k in keys if _num(ev.get(k)) is not None]
        if shown:
            lines.append(f"held-out reward-model eval: {', '.join(shown)}")
    return lines


def _health_line(h: Any) -> str | None:
    if not isinstance(h, dict):
        return None
    n = len(h.get("checked", []))
    if h.get("ok"):
        return f"health: all {n} checks passed"
    failed = ", ".join(
        f"{name} (first at step {f.get('first_step')}, {f.get('count')} steps)"
        for name, f in h.get("failed", {}).items()
    )
    return f"health: {len(h.get('failed', {}))} of {n} checks failed: {failed} (docs/health.md)"


def summary_lines(results: dict) -> list[str]:
    """A few lines for the console at the end of `rlhflab train`, from a trainer's final results
    (the dict also written to final_results.json): what ran and how long, the held-out accuracy
    ± standard error (before → after where known), the health summary and the run directory.
    Missing or null values are left out, so every trainer family (and a run stopped by a health
    check, `"status": "stopped_by_health"`) gets its own subset. Values are not redacted here:
    the caller prints them through `rlhflab.serialize.redact`."""
    r = results
    name = r.get("trainer", "run")
    steps = r.get("steps")
    head = f"{name} {'stopped by a health check' if r.get('status') == 'stopped_by_health' else 'finished'}"
    parts = []
    if steps is not None:
        parts.append(f"{steps} steps")
    wall = _num(r.get("wall_s"))
    if wall is not None:
        parts.append(f"in {duration(wall)}")
    text = f"{head}: {' '.join(parts)}" if parts else head
    loss = _num(r.get("final_loss"))
    if loss is not None:
        text += f", final loss {loss:.4g}"
    lines = [text]
    stopped = r.get("stopped_by")
    if isinstance(stopped, dict):
        lines.append(
            f"stopped by: {stopped.get('check')} at step {stopped.get('step')}: "
            f"{stopped.get('detail')}; resume from {r.get('checkpoint')} with --resume"
        )
    heldout = _heldout_line(r)
    if heldout:
        lines.append(heldout)
    components = _components_line(r)
    if components:
        lines.append(components)
    sets = r.get("eval_sets")
    for name, sub in sets.items() if isinstance(sets, dict) else ():
        line = _heldout_line(sub) if isinstance(sub, dict) else None
        if line:  # a further held-out set of eval.sets
            lines.append(f"[{name}: {sub.get('task')}] {line}")
    lines += _other_eval_lines(r)
    health = _health_line(r.get("health"))
    if health:
        lines.append(health)
    if r.get("run_dir"):
        files = ["final_results.json", "metrics.jsonl", "plots/"]
        if r.get("model_dir"):
            files.append("model/")
        lines.append(f"run directory: {r['run_dir']} ({', '.join(files)})")
    return lines


# -- The other commands' summaries (their whole results object: `--json`) ------------------------


def _show(v: float, is_acc: bool) -> str:
    return f"{100 * v:.1f}%" if is_acc else f"{v:.3f}"


def _pm(v: float, se: Any, is_acc: bool) -> str:
    """ "78.8% ± 1.8" (accuracies in points) or "0.512 ± 0.013"; the value alone without a finite
    standard error."""
    se = _num(se)
    if se is None:
        return _show(v, is_acc)
    return f"{_show(v, is_acc)} ± {100 * se:.1f}" if is_acc else f"{v:.3f} ± {se:.3f}"


def eval_lines(r: dict) -> list[str]:
    """`rlhflab eval MODEL --task | --data`: the held-out headline ± standard error (greedy, n
    problems) beside the majority-answer baseline (tasks), pass@k / maj@k when sampled, the
    reward components of a prompt dataset, and verifier errors when there were any."""
    name = r.get("headline_name") or ("correctness" if "accuracy" in r else "reward")
    value = _num(r.get("headline", r.get("accuracy")))
    se = r.get("headline_stderr", r.get("accuracy_stderr"))
    is_acc = name.startswith("correctness")
    label = "accuracy" if name == "correctness (task verifier)" else name
    lines = []
    if value is not None:
        text = f"held-out {label}: {_pm(value, se, is_acc)} (n={r.get('n')}, greedy)"
        base = _num(r.get("majority_accuracy"))
        if base is not None:
            text += (
                f"; majority-answer baseline {_pm(base, r.get('majority_accuracy_stderr'), True)}"
                f" (answering {r.get('majority_answer')!r} to all)"
            )
        lines.append(text)
    sampled = [
        f"{k} {_pm(v, r.get(f'{k}_stderr'), is_acc)}"
        for k, v in r.items()
        if k.startswith(("pass@", "maj@"))
        and k != "pass@k"
        and not k.endswith("_stderr")
        and _num(v) is not None
    ]
    if sampled:
        lines.append(f"sampled ({r.get('n_samples')} per problem): {', '.join(sampled)}")
    if (j := r.get("judge")) is not None:
        lines.append(
            f"judge {j['path']} against the verifier (score >= {j['threshold']:g} read as "
            f"correct): accuracy {j['accuracy']:.3f}, Cohen's kappa {j['kappa']:.3f}, AUC "
            f"{j['auc']:.3f}; mean score {j['score_mean']:.2f} (n={j['n']} parsed, "
            f"{j['parse_failed']} failed; verifier correct {j['verifier_correct']:.3f})"
        )
    parts = [f"{k[7:]} {_num(v):.3f}" for k, v in r.items()
             if k.startswith("reward/") and not k.endswith("_stderr") and _num(v) is not None]  # fmt: skip
    if parts:
        lines.append(f"reward components: {', '.join(parts)}")
    if r.get("verifier_errors"):
        lines.append(f"verifier errors: {r['verifier_errors']} completions (scored 0)")
    return lines


def eval_run_dir_lines(out: dict) -> list[str]:
    """`rlhflab eval RUN_DIR --checkpoints | --passk`: the curve's first and last points, pass@k
    before → after, and the files written."""
    lines = []
    curve = out.get("checkpoints")
    if isinstance(curve, dict):
        pts = [p for p in curve.get("points", []) if _num(p.get("headline")) is not None]
        text = f"checkpoints: {curve.get('headline_name')} at {len(pts)} points"
        if pts:
            text += (
                f", step {pts[0].get('step')} {pts[0]['headline']:.3f} → step "
                f"{pts[-1].get('step')} {pts[-1]['headline']:.3f}"
            )
        lines.append(f"{text} ({curve.get('json')}, {curve.get('png')})")
    passk = out.get("passk")
    if isinstance(passk, dict):
        for label in ("before", "after"):
            res = passk.get(label) or {}
            shown = [f"{m}@{k} {res[f'{m}@{k}']:.3f}" for m in ("pass", "maj")
                     for k in passk.get("ks", []) if _num(res.get(f"{m}@{k}")) is not None]  # fmt: skip
            if shown:
                lines.append(f"{label} training: {', '.join(shown)}")
        lines.append(
            f"pass@k: {passk.get('n_samples')} samples per problem, {passk.get('n')} problems "
            f"({passk.get('json')}, {passk.get('png')})"
        )
    return lines


def sweep_lines(r: dict) -> list[str]:
    """`rlhflab sweep`: runs trained and skipped, the tabulated metric per grid point (mean ±
    s.e. over seeds), and where the README and results are."""
    lines = [
        f"sweep {r.get('out_dir')}: {r.get('cells')} runs; trained {len(r.get('ran', []))}, "
        f"skipped {len(r.get('skipped', []))} (finished before)"
    ]
    points = r.get("points") or []
    if points:
        lines.append(f"{r.get('metric_name') or r.get('metric')} (final), mean ± s.e. over seeds:")
        for pt in points:
            m = pt.get("metric") or {}
            if not m.get("n"):
                shown = "no finished run"
            elif m.get("se") is None:
                shown = f"{m['mean']:.3f} (1 seed)"
            else:
                shown = f"{m['mean']:.3f} ± {m['se']:.3f} ({m['n']} seeds)"
            lines.append(f"  {pt.get('label')}: {shown}")
    if r.get("conclusion"):
        lines.append(r["conclusion"])
    if r.get("readme"):
        lines.append(f"report: {r['readme']} (table, plots; every number in results.json)")
    return lines


def compare_lines(r: dict) -> list[str]:
    """`rlhflab compare`: the held-out headline per preset (`heldout`: mean ± s.e. over seeds,
    and its mean before training) and where the table, plot and results are."""
    presets = r.get("presets") or {}
    lines = [f"compare: {len(presets)} presets × {r.get('seeds')} seeds in "
             f"{duration(r.get('wall_s') or 0)}"]  # fmt: skip
    names = sorted({p.get("headline_name") for p in presets.values()} - {None})
    if presets:
        lines.append(f"held-out {' / '.join(names) or 'headline'}, mean ± s.e. over seeds:")
    for name, p in presets.items():
        after, before = p.get("heldout") or {}, p.get("heldout_before") or {}
        if _num(after.get("mean")) is None:
            lines.append(f"  {name}: –")
            continue
        shown = f"{after['mean']:.3f}"
        if _num(after.get("se")) is not None:
            shown += f" ± {after['se']:.3f}"
        if _num(before.get("mean")) is not None:
            shown += f" (before {before['mean']:.3f})"
        lines.append(f"  {name}: {shown}")
    if r.get("conclusion"):
        lines.append(r["conclusion"])
    lines.append(f"table: {r.get('table')} (comparison.png, results.json beside it)")
    return lines


def replicate_lines(name: str, r: dict, json_path: str) -> list[str]:
    """`rlhflab replicate NAME`: wall-clock, the RL stage's held-out headline when it has one,
    and where every number (`json_path`) and the plot are (docs/replications.md reads them)."""
    if "share" in r:  # `--only i/N`: a share of the cells, no report
        return [
            f"replicate {name} share {r['share']}: ran {len(r['ran'])} cell(s), "
            f"{len(r['skipped'])} already finished, in {duration(r.get('wall_s') or 0)}",
            "gather every share with the same command and --report",
        ]
    if isinstance(r.get("verdict"), dict):  # a replication judged by its pre-registered criterion
        v = r["verdict"]
        ci = "no CI" if v["ci95"] is None else f"95% CI [{v['ci95'][0]:.3g}, {v['ci95'][1]:.3g}]"
        held = sum(c["holds"] for c in v["checks"])
        return [
            f"replicate {name}: {'REPRODUCED' if v['reproduced'] else 'NOT reproduced'} "
            f"({held}/{len(v['checks'])} checks hold; seeds {v['seeds']}); this command "
            f"{duration(r.get('wall_s') or 0)}, cells' own time summed "
            f"{duration(r.get('compute_s') or 0)}",
            f"claim: {v['claim']}",
            f"headline: {v['checks'][0]['what']} = {v['estimate']:.3g} ({ci})",
            f"results: {', '.join(r.get('files') or [json_path])}",
        ]
    lines = [f"replicate {name} finished in {duration(r.get('wall_s') or 0)}"]
    heldout = _heldout_line(r) if isinstance(r.get("headline"), dict) else None
    if heldout:
        lines.append(heldout)
    files = [json_path] + ([r["plot"]] if r.get("plot") else [])
    lines.append(f"results: {', '.join(files)} (what reproduced: docs/replications.md)")
    return lines

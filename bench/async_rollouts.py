"""Asynchronous vs synchronous rollouts on the quickstart task, side by side in one run.

Start: the quickstart's SFT stage (spell_backward 3-5 letters, Qwen3-shape "small" model, vocab
300, 130 steps, seed 0), built once. Each run: the quickstart's GRPO stage (16 prompts x group 8,
10 new tokens, PPO-clip, no KL, 1 torch thread per thread) for `--steps` steps, with
`rollout.mode` sync or async (max_staleness 1, the decoupled correction, cap 2). Held-out greedy
accuracy on the quickstart's 500 held-out problems at the end; wall-clock of the GRPO run
(set-up and the two held-out evaluations included, as `final_results.json`'s wall_s) and the
mean step time. The two modes alternate run by run (seed 0: sync then async, seed 1: async then
sync, ...), so a change in the machine's load hits both alike; every run is its own subprocess.

    python -m bench.async_rollouts --seeds 0 1 2 --steps 200
    python -m bench.async_rollouts --seeds 0 1 2 3 4 --steps 600 --async-steps 700 \
        --eval-every 100 --plot docs/async_heldout_vs_wallclock.png

`--modes sync async process` adds the async run with its generation in a process of its own
(`rollout.async_worker: process`, rlhflab.rollout.async_process) beside the thread's; the modes
rotate run by run (seed i starts at mode i mod 3), and `paired()` prints every pair's
wall-clock and accuracy differences, paired by seed, with 95% t intervals:

    python -m bench.async_rollouts --seeds 0 1 2 --steps 600 --modes sync async process \
        --out bench/async_results_process.json

`--async-steps` lets the async runs spend the wall-clock they save on more steps (the constant LR
after warm-up makes their first `--steps` steps the same run); `--eval-every` records the held-out
curve with the run's clock, `--plot` draws it. Writes bench/async_results.json (or --out) and
prints the markdown table of bench/RESULTS.md with the async − sync differences.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import common

RUNS = common.CACHE_DIR / "async_runs"
OUT = common.BENCH_DIR / "async_results.json"


def sft_model() -> Path:
    """The quickstart's SFT model (seed 0), trained once and cached."""
    marker = common.CACHE_DIR / "async_sft_model.txt"
    if marker.exists() and Path(marker.read_text().strip()).exists():
        return Path(marker.read_text().strip())
    from rlhflab.quickstart import build_configs
    from rlhflab.trainers import run_config

    sft_cfg, _ = build_configs(
        fast=False, root=RUNS, overrides=["sft.tracking.console=false", "sft.run.name=async_sft"]
    )
    res = run_config(sft_cfg)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(res["model_dir"])
    return Path(res["model_dir"])


def run_grpo(
    sft: str, mode: str, seed: int, steps: int, eval_every: int | None = None, extra=()
) -> dict:
    """One GRPO run of the quickstart's settings (in this process); held-out evaluation every
    `eval_every` steps (default: only before and after); `extra`: more dotted overrides of the
    GRPO stage (e.g. `rollout.max_staleness=2`)."""
    from rlhflab.quickstart import build_configs
    from rlhflab.trainers import run_config

    _, cfg = build_configs(
        fast=False,
        root=RUNS,
        overrides=[
            f"grpo.seed={seed}",
            f"grpo.train.steps={steps}",
            f"grpo.eval.every={eval_every or steps}",
            f"grpo.rollout.mode={'sync' if mode == 'sync' else 'async'}",
            *(["grpo.rollout.async_worker=process"] if mode == "process" else []),
            "grpo.tracking.console=false",
            f"grpo.run.name=async_{mode}_s{seed}",
            "grpo.run.save_model=false",
            *(f"grpo.{o}" for o in extra),
        ],
    )
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": sft})})
    t0 = time.perf_counter()
    res = run_config(cfg)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (Path(res["run_dir"]) / "metrics.jsonl").open()]
    steps_rows = [r for r in rows if "perf/step_s" in r]
    out = {
        "mode": mode,
        "seed": seed,
        "steps": res["steps"],
        "heldout_accuracy_before": res["heldout_accuracy_before"],
        "heldout_accuracy": res["heldout_accuracy"],
        "heldout_accuracy_stderr": res["heldout_accuracy_stderr"],
        "heldout_n": res["heldout_n"],
        "wall_s": wall,
        "step_s_mean": statistics.fmean(r["perf/step_s"] for r in steps_rows),
        "rollout_wait_s_mean": statistics.fmean(r["perf/rollout_s"] for r in steps_rows),
        # held-out greedy accuracy at every evaluation, with the run's clock (metrics time_s)
        "heldout_curve": [
            {"step": r["step"], "time_s": r["time_s"], "accuracy": r["eval/accuracy"]}
            for r in rows
            if "eval/accuracy" in r
        ],
    }
    if mode != "sync":
        out["staleness_mean"] = statistics.fmean(r["rollout/staleness"] for r in steps_rows)
        out["behav_ratio_mean"] = statistics.fmean(
            r["rollout/behav_ratio_mean"] for r in steps_rows
        )
        out["behav_ratio_max"] = max(r["rollout/behav_ratio_max"] for r in steps_rows)
    return out


def _mean_se(xs: list[float]) -> tuple[float, float]:
    m = statistics.fmean(xs)
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")
    return m, se


def table(results: list[dict]) -> str:
    lines = [
        "| mode | seeds | steps | held-out acc. before | held-out acc. after (mean ± s.e.) | "
        "wall-clock s (mean ± s.e.) | s/step | behaviour ratio mean / max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in ("sync", "async", "process"):
        rs = [r for r in results if r["mode"] == mode]
        if not rs:
            continue
        acc, acc_se = _mean_se([r["heldout_accuracy"] for r in rs])
        wall, wall_se = _mean_se([r["wall_s"] for r in rs])
        step = statistics.fmean(r["step_s_mean"] for r in rs)
        before = statistics.fmean(r["heldout_accuracy_before"] for r in rs)
        ratio = (
            f"{statistics.fmean(r['behav_ratio_mean'] for r in rs):.4f} / "
            f"{max(r['behav_ratio_max'] for r in rs):.3f}"
            if mode != "sync"
            else "—"
        )
        lines.append(
            f"| {mode} | {len(rs)} | {rs[0]['steps']} | {before:.3f} | {acc:.3f} ± {acc_se:.3f} | "
            f"{wall:.0f} ± {wall_se:.0f} | {step:.3f} | {ratio} |"
        )
    lines += ["", comparison(results)]
    return "\n".join(lines)


def comparison(results: list[dict]) -> str:
    """Async − sync held-out accuracy at the end of each run and, from the held-out curves, at
    the sync run's step count (mean over seeds ± the s.e. of the difference of the two means),
    and the wall-clock ratio."""
    sync = [r for r in results if r["mode"] == "sync"]
    asy = [r for r in results if r["mode"] == "async"]
    if len(sync) < 2 or len(asy) < 2:
        return ""

    def diff(a: list[float], b: list[float]) -> str:
        (ma, sa), (mb, sb) = _mean_se(a), _mean_se(b)
        return f"{ma - mb:+.3f} (s.e. of the difference {math.hypot(sa, sb):.3f})"

    n_sync = sync[0]["steps"]
    acc_sync = [r["heldout_accuracy"] for r in sync]
    acc_async = [r["heldout_accuracy"] for r in asy]
    wall = statistics.fmean(r["wall_s"] for r in asy) / statistics.fmean(r["wall_s"] for r in sync)
    out = [
        f"- end of run: async − sync accuracy {diff(acc_async, acc_sync)}; "
        f"async/sync wall-clock {wall:.2f}"
    ]
    at_n = [[c["accuracy"] for c in r["heldout_curve"] if c["step"] == n_sync] for r in asy]
    if all(at_n) and asy[0]["steps"] != n_sync:
        out.append(
            f"- at step {n_sync} (both): async − sync accuracy "
            f"{diff([a[0] for a in at_n], acc_sync)}"
        )
    return "\n".join(out)


def paired(results: list[dict]) -> dict:
    """Every pair of modes, paired by seed: the mean per-seed difference (a − b) of the GRPO run's
    wall-clock (s), its mean step time (s) and its final held-out accuracy, with 95% Student t
    intervals over the seeds both modes ran."""
    from rlhflab.replications.verdict import t_interval

    by = {(r["mode"], r["seed"]): r for r in results}
    modes = list(dict.fromkeys(r["mode"] for r in results))
    out = {}
    for i, a in enumerate(modes):
        for b in modes[i + 1 :]:
            seeds = sorted(s for m, s in by if m == a and (b, s) in by)
            if len(seeds) < 2:
                continue
            row = {"seeds": seeds}
            for key in ("wall_s", "step_s_mean", "heldout_accuracy"):
                m, lo, hi = t_interval([by[a, s][key] - by[b, s][key] for s in seeds])
                row[key] = {"mean": m, "ci95": [lo, hi]}
            out[f"{a} - {b}"] = row
    return out


def plot(results: list[dict], path: Path) -> None:
    """Held-out accuracy against the run's wall-clock (metrics time_s), every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r in results:
        c = r.get("heldout_curve") or []
        ax.plot(
            [p["time_s"] for p in c],
            [p["accuracy"] for p in c],
            color={"sync": "tab:blue", "async": "tab:orange"}.get(r["mode"], "tab:green"),
            marker="o",
            ms=3,
            alpha=0.8,
            label=f"{r['mode']} ({r['steps']} steps)",
        )
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=True))
    ax.legend(uniq.values(), uniq.keys())
    ax.set(xlabel="wall-clock of the GRPO run (s)", ylabel="held-out greedy accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument(
        "--async-steps", type=int, default=None,
        help="steps of the async runs (default --steps): async may spend its saved wall-clock "
        "on more steps; the constant LR after warm-up makes the first --steps identical",
    )  # fmt: skip
    ap.add_argument("--eval-every", type=int, default=None, help="held-out curve (default: end)")
    ap.add_argument("--plot", type=Path, default=None, help="held-out accuracy vs wall-clock PNG")
    ap.add_argument(
        "--async-set", nargs="*", default=[], metavar="KEY=VALUE",
        help="overrides of the async runs' GRPO stage (ablations: rollout.max_staleness=2, "
        "rollout.behav_correction=none)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=OUT, help="results JSON (default %(default)s)")
    ap.add_argument(
        "--modes", nargs="+", default=["sync", "async"], choices=["sync", "async", "process"],
        help="sync; async (generation in a thread); process (async, generation in a process)",
    )  # fmt: skip
    ap.add_argument("--one", nargs=3, metavar=("SFT", "MODE", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # a single run, in this subprocess
        sft, mode, seed = args.one
        extra = args.async_set if mode != "sync" else []
        print(json.dumps(run_grpo(sft, mode, int(seed), args.steps, args.eval_every, extra)))
        return
    common.setup()
    sft = str(sft_model())
    results = []
    for i, seed in enumerate(args.seeds):
        order = args.modes[i % len(args.modes) :] + args.modes[: i % len(args.modes)]
        for mode in order:
            steps = args.async_steps if mode != "sync" and args.async_steps else args.steps
            cmd = [sys.executable, "-m", "bench.async_rollouts", "--steps", str(steps),
                   "--one", sft, mode, str(seed)]  # fmt: skip
            if args.eval_every:
                cmd += ["--eval-every", str(args.eval_every)]
            if args.async_set:
                cmd += ["--async-set", *args.async_set]
            out = subprocess.run(
                cmd, capture_output=True, text=True, cwd=str(common.BENCH_DIR.parent)
            )
            if out.returncode != 0:
                raise RuntimeError(out.stderr[-3000:])
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
            args.out.write_text(
                json.dumps(
                    {
                        "steps": args.steps,
                        "async_steps": args.async_steps,
                        "async_set": args.async_set,
                        "modes": args.modes,
                        "runs": results,
                        "paired": paired(results),
                    },
                    indent=1,
                )
                + "\n"
            )
    print(table(results))
    print(json.dumps(paired(results), indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()

"""Multi-turn tool RL: SFT on calculator demonstrations, then GRPO with the calculator environment.

Task: products of two 3-digit numbers (reasoning_gym basic_arithmetic, configs/multiturn/*.yaml),
which the 0.5 M-parameter from-scratch model cannot compute in its head. Per seed:
    1. demonstrations from the task's training split: a share `--tool-share` of them call the
       calculator (user question → `<tool>calc: A * B</tool>` → user: the result →
       `<answer>P</answer>`), the others answer directly (`<answer>P</answer>`);
    2. SFT on them (configs/multiturn/calculator_sft.yaml; every assistant turn trained, the tool
       result masked);
    3. GRPO with `rlhflab.envs.arithmetic:CalculatorEnv` (configs/multiturn/calculator_grpo.yaml);
       held-out success, turns and tool calls per episode before and after (greedy episodes on
       the task's held-out problems, none of them in training).
Writes <out>/results.json and <out>/multiturn_calculator.png (calls per episode and success
over training, every seed). Usage:
    python -m bench.multiturn_calculator --seeds 0 1 2 --out bench/multiturn_results

Sandbox check (issue #37): `--calc-tool python` runs every calculator call as Python code in the
python tool's sandbox (bench/python_calc_env.py; the output equals the calculator's), and
`--sft-model DIR` reuses an SFT model (one seed) instead of training one, so the GRPO stage runs
once per sandbox from the same SFT model and seed:
    python -m bench.multiturn_calculator --seeds 0 --sft-model M --calc-tool python --out O
(under the rlhflab version whose sandbox is measured, e.g. with PYTHONPATH set to its src/).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "multiturn"


def run_seed(seed: int, out: Path, args) -> dict:
    from rlhflab.config import load_config
    from rlhflab.data.tasks import make_splits
    from rlhflab.envs.calculator_demos import demonstrations
    from rlhflab.trainers import sft

    root = out / f"seed{seed}"
    root.mkdir(parents=True, exist_ok=True)
    if args.sft_model is not None:
        return grpo_seed(seed, root, str(args.sft_model), float("nan"), args)
    sft_cfg = load_config(
        CONFIGS / "calculator_sft.yaml",
        [f"seed={seed}", f"run.root={root}", f"train.steps={args.sft_steps}"],
    )
    t = sft_cfg.task
    splits = make_splits(
        t.name, config=t.config, n_train=t.n_train, n_heldout=t.n_heldout, seed=t.seed
    )
    demos = root / "demos.jsonl"
    with open(demos, "w") as f:
        for row in demonstrations(splits.train, args.tool_share, seed):
            f.write(json.dumps(row) + "\n")
    sft_cfg = load_config(
        CONFIGS / "calculator_sft.yaml",
        [f"seed={seed}", f"run.root={root}", f"train.steps={args.sft_steps}", f"data.path={demos}"],
    )
    t0 = time.perf_counter()
    sft_res = sft.train(sft_cfg)
    return grpo_seed(seed, root, sft_res["model_dir"], time.perf_counter() - t0, args)


def grpo_seed(seed: int, root: Path, sft_model: str, t_sft: float, args) -> dict:
    """The GRPO stage of one seed from `sft_model`; with `--calc-tool python` every calculator
    call runs in the python sandbox (bench/python_calc_env.py) and its counts are reported."""
    from rlhflab.config import load_config
    from rlhflab.trainers import policy_gradient

    overrides = [
        f"seed={seed}",
        f"run.root={root}",
        f"model.name_or_path={sft_model}",
        f"train.steps={args.grpo_steps}",
        f"eval.every={args.eval_every}",
    ]
    if args.calc_tool == "python":
        overrides.append(
            f"env.class={Path(__file__).parent / 'python_calc_env.py'}:PythonCalculatorEnv"
        )
    grpo_cfg = load_config(CONFIGS / "calculator_grpo.yaml", overrides)
    t0 = time.perf_counter()
    res = policy_gradient.train(grpo_cfg)
    summary = summarize(res, seed, t_sft, time.perf_counter() - t0)
    if args.calc_tool == "python":
        import sys

        from rlhflab.envs import tools

        env_mod = next(m for n, m in sys.modules.items() if n.startswith("rlhflab_user_env_"))
        stats = dict(env_mod.STATS)
        stats["sandbox_ms_per_call"] = 1000 * stats["sandbox_s"] / max(stats["calls"], 1)
        stats["isolation"] = tools.sandbox_isolation()
        summary["sandbox"] = stats
    return summary


def resume_seed(seed: int, run_dir: Path) -> dict:
    """Finish an interrupted GRPO run (exact resume from its last checkpoint) and summarize it
    (wall-clock: the resumed part only)."""
    from rlhflab.config import load_config
    from rlhflab.trainers import policy_gradient

    cfg = load_config(run_dir / "config.yaml", [f"run.resume={run_dir}"])
    t0 = time.perf_counter()
    res = policy_gradient.train(cfg)
    return summarize(res, seed, float("nan"), time.perf_counter() - t0)


def summarize(res: dict, seed: int, t_sft: float, t_grpo: float) -> dict:
    """One seed's numbers from the GRPO run's results and metrics.jsonl."""
    with open(Path(res["run_dir"]) / "metrics.jsonl") as f:
        rows = [json.loads(x) for x in f]
    curve = [
        {
            "step": r["step"],
            "tool_calls": r["rollout/tool_calls_mean"],
            "success": r["rollout/success"],
            "turns": r["rollout/turns_mean"],
        }
        for r in rows
        if "rollout/tool_calls_mean" in r
    ]
    evals = [
        {k.removeprefix("eval/"): v for k, v in r.items() if k.startswith("eval/") or k == "step"}
        for r in rows
        if "eval/tool_calls" in r
    ]
    return {
        "seed": seed,
        "success_before": res["heldout_accuracy_before"],
        "success_after": res["heldout_accuracy"],
        "success_after_stderr": res["heldout_accuracy_stderr"],
        "heldout_n": res["heldout_n"],
        "evals": evals,
        "curve": curve,
        "sft_wall_s": round(t_sft, 1),
        "grpo_wall_s": round(t_grpo, 1),
    }


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error over seeds (Bessel)."""
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for r in results:
        steps = [c["step"] for c in r["curve"]]
        axes[0].plot(steps, [c["tool_calls"] for c in r["curve"]], label=f"seed {r['seed']}")
        axes[1].plot(steps, [c["success"] for c in r["curve"]], label=f"seed {r['seed']}")
    axes[0].set(xlabel="GRPO step", ylabel="tool calls per episode (rollouts)")
    axes[1].set(xlabel="GRPO step", ylabel="success (rollouts, T=1)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--tool-share", type=float, default=0.4)
    ap.add_argument("--sft-steps", type=int, default=1500)
    ap.add_argument("--grpo-steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("bench/multiturn_results"))
    ap.add_argument("--sft-model", type=Path, default=None, help="reuse this SFT model (no SFT)")
    ap.add_argument(
        "--calc-tool", choices=["calculator", "python"], default="calculator",
        help="python: every calculator call runs in the python tool's sandbox",
    )  # fmt: skip
    ap.add_argument(
        "--combine", type=Path, nargs="+", default=None,
        help="no runs: merge the results.json of these output folders (seeds run in parallel)",
    )  # fmt: skip
    ap.add_argument("--resume", type=Path, default=None, help="finish this interrupted GRPO run")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.combine:
        results = [
            r for d in args.combine for r in json.loads((d / "results.json").read_text())["seeds"]
        ]
        write_summary(results, args)
        return
    if args.resume:
        write_summary([resume_seed(args.seeds[0], args.resume)], args)
        return
    results = []
    for seed in args.seeds:
        results.append(run_seed(seed, args.out, args))
        write_summary(results, args)


def write_summary(results: list[dict], args) -> None:
    """results.json (per seed, and mean ± s.e. over seeds) and the plot, in args.out."""
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "seeds": results}
    for key in ("success_before", "success_after"):
        m, se = mean_se([r[key] for r in results])
        summary[key] = {"mean": m, "se": se}
    m, se = mean_se([r["success_after"] - r["success_before"] for r in results])
    summary["success_gain_paired"] = {"mean": m, "se": se}
    for when, idx in (("before", 0), ("after", -1)):
        m, se = mean_se([r["evals"][idx]["tool_calls"] for r in results])
        summary[f"tool_calls_{when}"] = {"mean": m, "se": se}
    # sampled episodes (T = 1): mean of the first and of the last 10 GRPO steps, over seeds
    for key in ("tool_calls", "success"):
        for when, part in (("first10", slice(0, 10)), ("last10", slice(-10, None))):
            per_seed = [
                sum(c[key] for c in r["curve"][part]) / len(r["curve"][part]) for r in results
            ]
            m, se = mean_se(per_seed)
            summary[f"rollout_{key}_{when}"] = {"mean": m, "se": se}
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    plot(results, args.out / "multiturn_calculator.png")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("seeds", "args")}))


if __name__ == "__main__":
    main()

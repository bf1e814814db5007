"""DPO over-optimisation (Rafailov et al. 2024, "Scaling Laws for Reward Model Overoptimization in
Direct Alignment Algorithms", arXiv 2406.02900), at small scale.

    rlhflab replicate dpo-overopt [configs/replications/dpo_overopt.yaml] --out runs/dpo-overopt

1. Policy and reference: the `sft` stage (or `experiment.policy`).
2. A β × training-length grid of offline DPO runs (`dpo` stage: pairs of the reference policy's own
   samples labelled by the verifier, one round, so the reference stays the SFT model), run by
   `rlhflab sweep` into `--out/<date>-dpo-overopt/` (its README has the table). With a constant
   learning rate and the same seed, a shorter run is the start of a longer one, so the lengths are
   points along one training trajectory per β.
3. For every finished run: KL(π‖π_ref) per completion, the Monte-Carlo estimate
   mean over held-out prompts of Σ_t [log π(y_t|·) − log π_ref(y_t|·)] with y ~ π (temperature 1);
   gold = the verifier's mean on those same samples, and the run's greedy held-out accuracy.
Output: `dpo_overopt.json`, `dpo_overopt.png` (gold against √KL, one line per β, mean ± s.e. over
seeds), the sweep's campaign folder.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from pydantic import Field

from rlhflab.replications import Counts, Experiment, PositiveFloats, begin, stage


class Spec(Experiment):
    """`experiment:` of dpo_overopt.yaml."""

    betas: PositiveFloats = Field(default_factory=lambda: [0.01, 0.1, 0.5])
    steps: Counts = Field(default_factory=lambda: [20, 60])
    seeds: int = Field(1, ge=1)
    kl_problems: int = Field(200, ge=1)
    max_new_tokens: int = Field(10, ge=1)
    seed: int = 0
    policy: str | None = None


def kl_and_gold(policy, reference, tokenizer, problems, verifier, *, instruction, max_new_tokens,
                seed: int, batch: int = 100) -> dict:  # fmt: skip
    """One sample per problem from `policy` (temperature 1): the mean and s.e. over problems of
    Σ_t log π − log π_ref (nats per completion; an unbiased estimate of KL(π‖π_ref)), and of the
    verifier's score of the samples."""
    import torch

    from rlhflab.data.formatting import encode_prompt
    from rlhflab.data.prompts import render_row
    from rlhflab.eval.accuracy import mean_and_stderr
    from rlhflab.rollout.engines import SamplingParams, make_engine
    from rlhflab.rollout.sampler import completion_logps, decode_completions

    engine = make_engine(None, policy, tokenizer)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=1.0)
    kls, gold = [], []
    with torch.no_grad():
        for s in range(0, len(problems), batch):
            chunk = problems[s : s + batch]
            prompts = [encode_prompt(tokenizer, render_row(tokenizer, p, instruction=instruction))
                       for p in chunk]  # fmt: skip
            ro = engine.generate(prompts, params, generator=gen)
            lp, _ = completion_logps(policy, ro)
            lr, _ = completion_logps(reference, ro)
            kls += ((lp - lr) * ro.mask).sum(dim=1).tolist()
            gold += verifier.score_batch(decode_completions(tokenizer, ro, engine.stop_token_ids),
                                         chunk)  # fmt: skip
    kl, kl_se = mean_and_stderr(kls)
    g, g_se = mean_and_stderr([1.0 if x >= 1.0 else 0.0 for x in gold])
    return {"kl": kl, "kl_stderr": kl_se, "gold_sampled": g, "gold_sampled_stderr": g_se}


def run(spec: dict, out: Path, *, source: str) -> dict:
    """Run the replication (module doc); returns and writes dpo_overopt.json."""
    import json

    from rlhflab.data.formatting import task_instruction
    from rlhflab.data.tasks import make_splits
    from rlhflab.eval.accuracy import mean_and_stderr
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.rewards.verifier import Verifier
    from rlhflab.serialize import write_json_atomic, write_yaml_atomic
    from rlhflab.sweep import run_sweep
    from rlhflab.trainers import run_config

    exp, t0, runs = begin(Spec, spec, out, source)
    stage(spec, "dpo", source, model={"name_or_path": "<policy>"})
    timings = {}
    policy = exp.policy
    if policy is None:
        sft = run_config(stage(spec, "sft", source, run={"root": runs}))
        policy, timings["sft_s"] = sft["model_dir"], sft["wall_s"]
    dpo = stage(spec, "dpo", source, model={"name_or_path": policy})
    dpo_path = out / "dpo.yaml"
    write_yaml_atomic(dpo_path, dpo.model_dump(mode="json"))
    t1 = time.perf_counter()
    sweep = run_sweep(
        str(dpo_path),
        grid_items=[
            f"loss.args.beta={','.join(map(str, exp.betas))}",
            f"train.steps={','.join(map(str, exp.steps))}",
        ],
        seeds=exp.seeds,
        root=str(out),
        slug="dpo-overopt",
    )
    timings["sweep_s"] = round(time.perf_counter() - t1, 2)
    t2 = time.perf_counter()
    task = dpo.task
    problems = make_splits(task.name, config=task.config, n_train=task.n_train,
                           n_heldout=exp.kl_problems, seed=task.seed).heldout  # fmt: skip
    tokenizer = load_tokenizer(policy)
    reference = load_model(policy).eval()
    verifier = Verifier(answer_format=task.answer_format, reward=task.reward)
    instruction = task_instruction(task)
    camp = Path(sweep["out_dir"])
    results = json.loads((camp / "results.json").read_text())
    points = []
    for pt in results["points"]:
        per_seed = []
        for r in pt["runs"]:
            model = load_model(str(camp / r["run_dir"] / "model")).eval()
            m = kl_and_gold(model, reference, tokenizer, problems, verifier,
                            instruction=instruction, max_new_tokens=exp.max_new_tokens,
                            seed=exp.seed + 777)  # fmt: skip
            per_seed.append({**m, "seed": r["seed"], "heldout_greedy_accuracy": r["metric"],
                             "heldout_greedy_accuracy_before": r["metric_before"],
                             "heldout_n": r["heldout_n"]})  # fmt: skip
        agg = {}
        for key in ("kl", "gold_sampled", "heldout_greedy_accuracy"):
            mean, se = mean_and_stderr([s[key] for s in per_seed])
            agg[key], agg[f"{key}_stderr_over_seeds"] = mean, None if math.isnan(se) else se
        agg["heldout_greedy_accuracy_before"] = per_seed[0]["heldout_greedy_accuracy_before"]
        points.append({"beta": float(pt["point"]["loss.args.beta"]),
                       "steps": int(pt["point"]["train.steps"]), **agg, "seeds": per_seed})  # fmt: skip
    # The reference itself: KL 0 by construction, its sampled gold.
    ref = kl_and_gold(reference, reference, tokenizer, problems, verifier, instruction=instruction,
                      max_new_tokens=exp.max_new_tokens, seed=exp.seed + 777)  # fmt: skip
    timings["kl_s"] = round(time.perf_counter() - t2, 2)
    summary = {
        "policy": policy,
        "task": {"name": task.name, "config": task.config},
        "kl_problems": len(problems),
        "reference": ref,
        "points": points,
        "campaign": str(camp),
        "timings": timings,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    write_json_atomic(out / "dpo_overopt.json", summary)
    plot(summary, out / "dpo_overopt.png")
    return {**summary, "plot": str(out / "dpo_overopt.png")}


def _err(point: dict, key: str) -> float:
    """s.e. over seeds, else (one seed) the run's s.e. over problems."""
    se = point.get(f"{key}_stderr_over_seeds")
    if se is not None:
        return se
    run = point["seeds"][0]
    if key == "gold_sampled":
        return run["gold_sampled_stderr"]
    p, n = run[key], run.get("heldout_n") or 0
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else 0.0


def plot(summary: dict, path: Path) -> None:
    """Gold (sampled correctness, left; greedy held-out accuracy, right) against √KL, a line per β
    through its training lengths, starting at the reference (KL 0). Error bars: s.e. over seeds;
    with one seed, the run's own s.e. over problems."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    ref = summary["reference"]
    for beta in sorted({p["beta"] for p in summary["points"]}):
        pts = sorted((p for p in summary["points"] if p["beta"] == beta), key=lambda p: p["steps"])
        x = [0.0] + [math.sqrt(max(p["kl"], 0.0)) for p in pts]
        for ax, key, start in ((axes[0], "gold_sampled", ref["gold_sampled"]),
                               (axes[1], "heldout_greedy_accuracy",
                                pts[0].get("heldout_greedy_accuracy_before"))):  # fmt: skip
            xs, ys = x, [start] + [p[key] for p in pts]
            errs = [0.0] + [_err(p, key) for p in pts]
            line = ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=f"β = {beta:g}")
            for p, xx in zip(pts, x[1:], strict=True):
                ax.annotate(str(p["steps"]), (xx, p[key]), fontsize=6, color=line[0].get_color(),
                            textcoords="offset points", xytext=(3, 3))  # fmt: skip
    axes[0].set_title("gold on samples (verifier), y ~ π")
    axes[1].set_title("held-out greedy accuracy")
    for ax in axes:
        ax.set_xlabel("√KL(π‖π_ref) (nats^½ per completion)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

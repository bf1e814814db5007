"""Reward-model over-optimisation (Gao, Schulman & Hilton 2022, "Scaling Laws for Reward Model
Overoptimization", arXiv 2210.10760), at small scale.

    rlhflab replicate rm-overopt [configs/replications/rm_overopt.yaml] --out runs/rm-overopt

1. Policy: the `sft` stage (a small model from scratch; `experiment.policy` skips it).
2. Gold reward: the task's verifier (1 correct, 0 not). Proxy RM: an ORM (`rm` stage) trained on the
   policy's own samples labelled by the gold verifier (Gao et al. train proxies on labels of a
   gold RM; here the gold is a verifier, so the proxy's score σ(z) = P(correct) is on the gold's
   scale).
3. Best-of-n against the proxy on held-out problems: for each n, the proxy picks the best of n
   samples; gold = the verifier's mean on the picks, proxy = the proxy's mean score on them
   (mean over `n_resamples` random subsets of a pool of max(n) samples per problem, s.e. over
   problems); KL(best-of-n ‖ policy) = log n − (n−1)/n nats (Gao et al. §2, after Stiennon 2020).
4. RL against the proxy (`rl` stage, GRPO): the proxy is the only trained reward; the gold verifier
   is a weight-0 component, so each step logs the gold (`rollout/reward/correctness_mean`) and the
   proxy (`rollout/reward/reward_model_mean`) of the same sampled rollouts, and the k3 KL estimate
   per completion (`policy/kl_seq`, summed over tokens; logged because kl.coef > 0).
Output (`--out`): `rm_overopt.json` (both curves), `rm_overopt.png` (gold and proxy against √KL,
best-of-n and RL side by side), `runs/` (every run).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from pydantic import Field

from rlhflab.replications import Counts, Experiment, begin, stage


class Spec(Experiment):
    """`experiment:` of rm_overopt.yaml."""

    ns: Counts = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    heldout_problems: int = Field(200, ge=1)
    max_new_tokens: int = Field(10, ge=1)
    n_resamples: int = Field(16, ge=1)
    seed: int = 0
    policy: str | None = None  # an existing start policy: the sft stage is skipped
    proxy_rm: str | None = None  # an existing proxy ORM (trained on this policy): rm is skipped


def bon_kl(n: int) -> float:
    """KL(best-of-n ‖ base) = log n − (n − 1)/n nats (the analytic form Gao et al. use, §2)."""
    return math.log(n) - (n - 1) / n


def run(spec: dict, out: Path, *, source: str) -> dict:
    """Run the replication (module doc); returns and writes rm_overopt.json."""

    from rlhflab.data.tasks import make_splits
    from rlhflab.eval.best_of_n import best_of_n_eval, selection_curve
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.rewards.reward_model import RewardModelScorer
    from rlhflab.rewards.verifier import Verifier
    from rlhflab.serialize import write_json_atomic
    from rlhflab.tracking import read_metrics
    from rlhflab.trainers import run_config

    exp, t0, runs = begin(Spec, spec, out, source)
    # Validate every stage before the first run.
    placeholder = {"model": {"name_or_path": "<start policy>"}, "run": {"root": runs}}
    stage(spec, "rm", source, **placeholder)
    stage(spec, "rl", source, **placeholder)
    timings = {}
    policy = exp.policy
    if policy is None:
        sft = run_config(stage(spec, "sft", source, run={"root": runs}))
        policy, timings["sft_s"] = sft["model_dir"], sft["wall_s"]
    rm_cfg = stage(spec, "rm", source, model={"name_or_path": policy}, run={"root": runs})
    if exp.proxy_rm is None:
        rm = run_config(rm_cfg)
        timings["rm_s"] = rm["wall_s"]
    else:
        rm = {"model_dir": exp.proxy_rm, "eval": None}

    # Best-of-n against the proxy on held-out problems.
    t1 = time.perf_counter()
    task = rm_cfg.task
    splits = make_splits(task.name, config=task.config, n_train=task.n_train,
                         n_heldout=exp.heldout_problems, seed=task.seed)  # fmt: skip
    proxy = RewardModelScorer.from_pretrained(rm["model_dir"], kind="orm")
    ns = sorted(exp.ns)
    bon = best_of_n_eval(load_model(policy).eval(), load_tokenizer(policy), splits.heldout,
                         Verifier(answer_format=task.answer_format), {"proxy": proxy}, ns=ns,
                         max_new_tokens=exp.max_new_tokens, seed=exp.seed + 12345,
                         n_resamples=exp.n_resamples)  # fmt: skip
    gold = bon["curves"]["proxy"]
    scores = bon["rm_scores"]["proxy"]
    # The proxy's own score of the pick: the same subsets (same seed), scores as the "outcome".
    proxy_curve = selection_curve(scores, scores, ns, n_resamples=exp.n_resamples,
                                  seed=exp.seed + 12345)  # fmt: skip
    best_of_n = [
        {"n": n, "kl": bon_kl(n), "sqrt_kl": math.sqrt(bon_kl(n)),
         "gold": gold[n]["accuracy"], "gold_stderr": gold[n]["stderr"],
         "proxy": proxy_curve[n]["accuracy"], "proxy_stderr": proxy_curve[n]["stderr"],
         "oracle": gold[n]["oracle"]}
        for n in ns
    ]  # fmt: skip
    timings["best_of_n_s"] = round(time.perf_counter() - t1, 2)

    # RL against the proxy, gold logged beside it.
    components = [
        {"name": "reward_model", "weight": 1.0,
         "args": {"path": rm["model_dir"], "kind": "orm", "normalize": "none"}},
        {"name": "correctness", "weight": 0.0},
    ]  # fmt: skip
    rl = run_config(stage(spec, "rl", source, model={"name_or_path": policy},
                          reward={"components": components}, run={"root": runs}))  # fmt: skip
    timings["rl_s"] = rl["wall_s"]
    rows = read_metrics(Path(rl["run_dir"]) / "metrics.jsonl")
    rl_curve = [
        {"step": r["step"], "kl": r["policy/kl_seq"],
         "sqrt_kl": math.sqrt(max(r["policy/kl_seq"], 0.0)),
         "gold": r["rollout/reward/correctness_mean"],
         "proxy": r["rollout/reward/reward_model_mean"]}
        for r in rows
        if all(k in r for k in ("policy/kl_seq", "rollout/reward/correctness_mean",
                                "rollout/reward/reward_model_mean"))
    ]  # fmt: skip
    heldout = [
        {"step": r["step"], "accuracy": r["eval/accuracy"]} for r in rows if "eval/accuracy" in r
    ]
    results = {
        "policy": policy,
        "proxy_rm": rm["model_dir"],
        "proxy_rm_eval": rm.get("eval"),
        "task": {"name": task.name, "config": task.config},
        "heldout_problems": len(splits.heldout),
        "best_of_n": best_of_n,
        "rl": rl_curve,
        "rl_heldout_greedy_accuracy": heldout,
        "rl_run": rl["run_dir"],
        "timings": timings,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "rm_overopt.json", results)
    plot(results, out / "rm_overopt.png")
    return {**results, "plot": str(out / "rm_overopt.png")}


def _smooth(values: list[float], k: int) -> list[float]:
    """Trailing moving average over `k` points (fewer at the start)."""
    return [sum(values[max(0, i - k + 1) : i + 1]) / (i + 1 - max(0, i - k + 1))
            for i in range(len(values))]  # fmt: skip


def plot(results: dict, path: Path) -> None:
    """Gold and proxy against √KL: best-of-n (left, ± s.e.) and RL (right, 10-step averages)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    b = results["best_of_n"]
    x = [p["sqrt_kl"] for p in b]
    for key, color in (("gold", "tab:orange"), ("proxy", "tab:blue")):
        axes[0].errorbar(x, [p[key] for p in b], yerr=[p[f"{key}_stderr"] or 0 for p in b],
                         marker="o", capsize=3, color=color, label=f"{key} ({'verifier' if key == 'gold' else 'proxy ORM'})")  # fmt: skip
    for p in b:
        axes[0].annotate(f"n={p['n']}", (p["sqrt_kl"], p["gold"]), fontsize=7,
                         textcoords="offset points", xytext=(0, -12))  # fmt: skip
    axes[0].set_title("best-of-n against the proxy (held-out)")
    rl = results["rl"]
    if rl:
        xs = _smooth([p["sqrt_kl"] for p in rl], 10)
        for key, color in (("gold", "tab:orange"), ("proxy", "tab:blue")):
            axes[1].plot(xs, _smooth([p[key] for p in rl], 10), color=color, label=key)
    axes[1].set_title("GRPO against the proxy (training rollouts, 10-step means)")
    for ax in axes:
        ax.set_xlabel("√KL (nats^½)")
        ax.set_ylabel("score (gold: fraction correct; proxy: P(correct))")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

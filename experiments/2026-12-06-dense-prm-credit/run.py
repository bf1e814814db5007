"""GRPO with dense PRM credit against outcome-only GRPO on chained arithmetic (issue #43).

From nothing, with rlhflab's public API only (the presets through `load_config` + `run_config`,
`rlhflab.data.prm` for the worked solutions, `rlhflab.eval.accuracy.evaluate`, `rlhflab.stats`):

1. SFT data: the canonical worked solution of every training problem of the task
   ("a op b = c" per line, then "<answer>v</answer>"), written to ROOT/sft_worked_solutions.jsonl.
2. SFT: a `small` model (~0.6 M parameters) built from scratch on those rows
   (configs/sft/tiny_scratch.yaml with overrides).
3. PRM: configs/rm/prm.yaml started from the SFT model (worked solutions, half with one planted
   error, exact step labels from the checker).
4. GRPO, two arms x seeds, from configs/rm/grpo_process_prm.yaml; the arms differ only in
   `reward.components` and `loss.advantage`:
     outcome: correctness (weight 1), group_zscore
     dense:   the PRM with credit: dense (weight 1) + correctness (weight 1), process_group_zscore
5. Held-out: every final model (and the start policy) greedy on the same held-out problems, per
   problem (`evaluate(..., return_scores=True)`, checked against each run's own final
   evaluation); the paired difference dense - outcome per problem within each seed (pooled over
   seeds; t interval and a bootstrap over problems that keeps every seed of a problem) and the t
   interval over the per-seed differences. Written to results-<setting>.json in this folder,
   for each GRPO setting in SETTINGS (both arms, every seed).

Usage (from the repository root; resumable: a finished stage is read back from ROOT):
    python experiments/2026-12-06-dense-prm-credit/run.py --root runs/dense-prm-credit
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The task every stage uses: chain_sum, 3-4 one-digit terms (the PRM preset has 1-2 digits), bare
# questions (no answer-format instruction: the SFT rows, the PRM's worked solutions and the GRPO
# prompts render the question alone, so the three agree token for token).
TASK = [
    "task.name=chain_sum",
    "task.config={min_terms: 3, max_terms: 4, min_digits: 1, max_digits: 1}",
    "task.n_train=20000",
    "task.n_heldout=500",
    "task.seed=0",
    "task.answer_format=tags",
    "task.instruction=none",
]
SFT = [
    "model.build={size: small, arch: qwen3, vocab_size: 1024, max_position_embeddings: 192}",
    "train.steps=400",
    "train.max_len=160",
    "eval.n=200",
    "eval.max_new_tokens=64",
    "precision.threads=1",
    "tracking.console=false",
]
PRM = [
    "train.steps=1500",
    "optim.lr=1.0e-3",
    "eval.n_problems=256",
    "precision.threads=1",
    "tracking.console=false",
]
GRPO = [
    "rollout.max_new_tokens=64",
    "eval.every=25",
    "eval.n=500",
    "eval.max_new_tokens=64",
    "precision.threads=1",
    "tracking.console=false",
]
# GRPO settings, each run for both arms and every seed (ROOT/<setting>/). "lr3e-4" was run first
# (the quickstart GRPO's learning rate); "lr3e-5" (the preset's) after it, because at 3e-4 both
# arms fell far below the start policy within 25 steps; "lr1e-4" last, because at 3e-5 neither
# arm moved in 200 steps. All are reported.
SETTINGS = {
    "lr3e-4": ["train.steps=100", "optim.lr=3.0e-4"],
    "lr3e-5": ["train.steps=200", "optim.lr=3.0e-5"],
    "lr1e-4": ["train.steps=200", "optim.lr=1.0e-4"],
}
SEEDS = (0, 1, 2)


def arm_overrides(arm: str, prm: str) -> list[str]:
    """What differs between the arms: the reward components and the advantage."""
    if arm == "outcome":
        return [
            "reward.components=[{name: correctness, weight: 1.0}]",
            "loss.advantage=group_zscore",
        ]
    return [
        "reward.components=[{name: reward_model, weight: 1.0, args: {path: " + prm
        + ", kind: prm, credit: dense, step_separator: \"\\n\"}}, {name: correctness, weight: 1.0}]",
        "loss.advantage=process_group_zscore",
    ]  # fmt: skip


def train(preset: str, overrides: list[str], root: Path, name: str) -> dict:
    """Run `preset` with `overrides` into ROOT/<name>-<timestamp> (skipped when ROOT/<name>.json
    holds its results); returns the trainer's final results."""
    from rlhflab.config import load_config
    from rlhflab.serialize import to_json
    from rlhflab.trainers import run_config

    done = root / f"{name}.json"
    if done.exists():
        return json.loads(done.read_text())
    cfg = load_config(preset, [*overrides, f"run.name={name}", f"run.root={root}"])
    res = run_config(cfg)
    done.write_text(to_json(res, indent=2, default=str) + "\n")
    return res


def write_sft_rows(root: Path) -> Path:
    """The canonical worked solution of each training problem, as prompt/completion rows."""
    from rlhflab.config import load_config
    from rlhflab.data.prm import solution_text, solve_steps
    from rlhflab.data.tasks import make_splits
    from rlhflab.serialize import to_json

    path = root / "sft_worked_solutions.jsonl"
    if path.exists():
        return path
    t = load_config("configs/rm/prm.yaml", TASK).task
    splits = make_splits(t.name, config=t.config, n_train=t.n_train, n_heldout=0, seed=t.seed)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        for p in splits.train:
            steps = solve_steps(p.entry["metadata"]["expression"])
            row = {
                "prompt": p.question,
                "completion": solution_text(steps, f"<answer>{p.answer}</answer>"),
            }
            fh.write(to_json(row) + "\n")
    tmp.rename(path)
    return path


def heldout_scores(model_dir: str, run_config_path: Path, *, samples: int = 0) -> dict:
    """Greedy per-problem correctness of `model_dir` on the held-out problems of the run whose
    resolved config is `run_config_path` (the trainer's own selection: make_splits, first eval.n),
    and with `samples` > 0 the mean per-sample correctness at T = 1 (pass@1)."""
    import torch

    from rlhflab.config import load_config
    from rlhflab.data.formatting import task_instruction
    from rlhflab.data.tasks import make_splits
    from rlhflab.eval.accuracy import evaluate
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.rewards.verifier import Verifier

    torch.set_num_threads(1)
    cfg = load_config(run_config_path)
    t = cfg.task
    splits = make_splits(
        t.name, config=t.config, n_train=t.n_train, n_heldout=t.n_heldout, seed=t.seed
    )
    problems = splits.heldout[: cfg.eval.n]
    res = evaluate(
        load_model(model_dir).eval(),
        load_tokenizer(model_dir),
        problems,
        Verifier(answer_format=t.answer_format, reward=t.reward, extractor=t.extractor),
        max_new_tokens=cfg.eval.max_new_tokens,
        k=[1] if samples else 0,
        n_samples=samples,
        temperature=1.0,
        seed=cfg.seed,
        system=t.system,
        instruction=task_instruction(t),
        return_scores=True,
    )
    out = {"greedy": res["per_problem"]["accuracy"], "accuracy": res["accuracy"]}
    if samples:
        out["pass@1"] = res["pass@1"]
    return out


def curves(run_dir: str) -> dict:
    """Held-out accuracy at each evaluation and a few training metrics, from metrics.jsonl."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    keys = ("eval/accuracy", "rollout/steps_mean", "rollout/no_step_frac",
            "rollout/reward/correctness_mean", "rollout/reward/reward_model_mean", "policy/kl_ref")  # fmt: skip
    out: dict = {k: [] for k in keys}
    for r in rows:
        for k in keys:
            if k in r and r[k] is not None:
                out[k].append((r.get("step"), r[k]))
    return out


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="runs/dense-prm-credit")
    ap.add_argument("--stage", choices=["sft", "prm", "grpo", "all"], default="all")
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated SETTINGS keys")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    t0 = time.perf_counter()

    rows = write_sft_rows(root)
    sft = train("configs/sft/tiny_scratch.yaml",
                [*TASK, *SFT, "data.source=jsonl", f"data.path={rows}"], root, "sft")  # fmt: skip
    policy = sft["model_dir"]
    start_file = root / "start_policy_eval.json"
    if not start_file.exists():
        start = heldout_scores(policy, Path(sft["run_dir"]) / "config.yaml", samples=8)
        start_file.write_text(json.dumps(start) + "\n")
    start = json.loads(start_file.read_text())
    print(f"start policy: greedy {start['accuracy']:.3f}, per sample (T=1) {start['pass@1']:.3f}")
    if args.stage == "sft":
        return
    prm = train("configs/rm/prm.yaml", [*TASK, *PRM, f"model.name_or_path={policy}"], root, "prm")
    if args.stage == "prm":
        return
    for setting in args.settings.split(","):
        runs = {}
        sub = root / setting
        sub.mkdir(exist_ok=True)
        for seed in seeds:
            for arm in ("outcome", "dense"):
                name = f"grpo-{arm}-s{seed}"
                runs[name] = train(
                    "configs/rm/grpo_process_prm.yaml",
                    [*TASK, *GRPO, *SETTINGS[setting], f"seed={seed}",
                     f"model.name_or_path={policy}", *arm_overrides(arm, prm["model_dir"])],
                    sub, name,
                )  # fmt: skip
        if args.stage != "grpo" and len(seeds) > 1:
            report(sub, setting, sft, prm, start, runs, seeds)
    print(f"wall {time.perf_counter() - t0:.0f} s")


def report(root: Path, setting: str, sft: dict, prm: dict, start: dict, runs: dict,
           seeds: list[int]) -> None:  # fmt: skip
    """Per-problem held-out scores of every final model, the paired differences, the curves:
    results-<setting>.json in this folder."""
    from rlhflab.stats import bootstrap_interval, paired_difference

    per = {}
    for name, res in runs.items():
        f = root / f"{name}.heldout.json"
        if not f.exists():
            f.write_text(
                json.dumps(heldout_scores(res["model_dir"], Path(res["run_dir"]) / "config.yaml"))
                + "\n"
            )
        per[name] = json.loads(f.read_text())
        own = res["heldout_accuracy"]
        if abs(per[name]["accuracy"] - own) > 1e-9:
            raise SystemExit(f"{name}: re-evaluated {per[name]['accuracy']} != the run's own {own}")
    acc = {
        arm: [per[f"grpo-{arm}-s{s}"]["accuracy"] for s in seeds] for arm in ("outcome", "dense")
    }
    by_seed = paired_difference(acc["dense"], acc["outcome"])
    dense = [x for s in seeds for x in per[f"grpo-dense-s{s}"]["greedy"]]
    outcome = [x for s in seeds for x in per[f"grpo-outcome-s{s}"]["greedy"]]
    pooled = paired_difference(dense, outcome)
    n = len(per[f"grpo-dense-s{seeds[0]}"]["greedy"])
    diffs = [[per[f"grpo-dense-s{s}"]["greedy"][i] - per[f"grpo-outcome-s{s}"]["greedy"][i]
              for s in seeds] for i in range(n)]  # fmt: skip
    boot = bootstrap_interval(
        lambda idx: math.fsum(d for i in idx for d in diffs[i]) / (len(idx) * len(seeds)),
        n,
        n_boot=2000,
        seed=0,
    )
    results = {
        "setting": {"name": setting, "overrides": SETTINGS[setting], "common": GRPO, "task": TASK},
        "seeds": seeds,
        "heldout_problems": n,
        "start_policy": {"greedy": start["accuracy"], "per_sample_T1": start["pass@1"]},
        "sft": {"heldout_accuracy": sft["heldout_accuracy"], "wall_s": sft["wall_s"]},
        "prm": {"eval": prm.get("eval"), "wall_s": prm["wall_s"]},
        "final_heldout_accuracy": acc,
        "dense_minus_outcome": {
            "per_seed_t": {k: by_seed[k] for k in ("diffs", "mean", "lo", "hi", "sd", "n")},
            "per_problem_pooled_t": {k: pooled[k] for k in ("mean", "lo", "hi", "n")},
            "per_problem_bootstrap_over_problems": dict(
                zip(("mean", "lo", "hi"), boot, strict=True)
            ),
        },
        "curves": {name: curves(res["run_dir"]) for name, res in runs.items()},
        "wall_s": {name: res["wall_s"] for name, res in runs.items()},
    }
    (HERE / f"results-{setting}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(
        json.dumps(
            {
                k: results[k]
                for k in ("start_policy", "final_heldout_accuracy", "dense_minus_outcome")
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()

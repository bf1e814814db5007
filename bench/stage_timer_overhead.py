"""What the per-stage timers (`rlhflab.throughput.StageTimer`) cost on CPU: the quickstart's GRPO
step with the timers on and off (`RLHFLAB_STAGE_TIMERS=0`), interleaved.

    python bench/stage_timer_overhead.py [--reps 6] [--steps 6] [--sft-steps 20] [--out FILE]

1. An SFT model of the quickstart's shape (the quickstart preset's SFT stage, `--sft-steps` steps:
   only the shape and a non-degenerate policy matter here, not its accuracy).
2. `--reps` pairs of GRPO runs with the quickstart's GRPO settings (16 prompts × 8 samples, 10 new
   tokens, one thread), `--steps` steps each, no evaluation, one run with the timers and one
   without in each pair, the order alternating from pair to pair. Per run: the median
   `perf/step_s` (the harness's own clock, logged with the timers off too) over its steps but the
   first (warm-up). Reported: the median over pairs of (on − off) and its ratio to the off median.
3. The timer's own bookkeeping in isolation: seconds per `stage()` block (a tight loop), times
   the blocks a GRPO step opens — a bound that no step-to-step noise hides.

The machine's load changes step times by more than the timers cost: read (2) as "no difference
visible", (3) as the cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _run_grpo(grpo_cfg, model_dir: str, root: Path, name: str, steps: int, timers: bool) -> float:
    from rlhflab.trainers import run_config

    os.environ["RLHFLAB_STAGE_TIMERS"] = "1" if timers else "0"
    cfg = grpo_cfg.model_copy(
        update={
            "model": grpo_cfg.model.model_copy(update={"name_or_path": model_dir}),
            "train": grpo_cfg.train.model_copy(update={"steps": steps}),
            "eval": grpo_cfg.eval.model_copy(update={"every": 0, "n": 0}),
            "tracking": grpo_cfg.tracking.model_copy(update={"console": False}),
            "run": grpo_cfg.run.model_copy(
                update={"root": str(root), "name": name, "save_model": False}
            ),
        }
    )
    res = run_config(cfg)
    rows = [
        json.loads(x) for x in (Path(res["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    step_s = [r["perf/step_s"] for r in rows if "perf/step_s" in r][1:]  # the first: warm-up
    assert all(("perf/update_s" in r) == timers for r in rows if "perf/step_s" in r)
    return statistics.median(step_s)


def _stage_block_seconds(n: int = 200_000) -> float:
    from rlhflab.throughput import StageTimer

    timer = StageTimer("cpu", enabled=True)
    timer.begin()
    t0 = time.perf_counter()
    for _ in range(n):
        with timer.stage("update"):
            pass
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--sft-steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from rlhflab.quickstart import build_configs
    from rlhflab.trainers import run_config

    root = Path(tempfile.mkdtemp(prefix="stage-timer-bench-"))
    sft_cfg, grpo_cfg = build_configs(fast=True, root=root)
    sft_cfg = sft_cfg.model_copy(
        update={
            "train": sft_cfg.train.model_copy(update={"steps": args.sft_steps}),
            "eval": sft_cfg.eval.model_copy(update={"n": 0}),
            "tracking": sft_cfg.tracking.model_copy(update={"console": False}),
        }
    )
    model_dir = run_config(sft_cfg)["model_dir"]

    on, off, diffs = [], [], []
    for rep in range(args.reps):
        order = (True, False) if rep % 2 == 0 else (False, True)
        got = {}
        for timers in order:
            got[timers] = _run_grpo(
                grpo_cfg, model_dir, root, f"r{rep}-{int(timers)}", args.steps, timers
            )
        on.append(got[True])
        off.append(got[False])
        diffs.append(got[True] - got[False])
        print(f"pair {rep}: on {got[True]:.4f} s  off {got[False]:.4f} s", file=sys.stderr)
    block_s = _stage_block_seconds()
    blocks_per_step = 8  # GRPO: rollout, logp_old, ref (twice), values, update, weight_sync, eval
    result = {
        "what": "quickstart GRPO step (16x8, 10 new tokens, 1 thread), CPU, timers on vs off",
        "reps": args.reps,
        "steps_per_run": args.steps,
        "median_step_s_on": statistics.median(on),
        "median_step_s_off": statistics.median(off),
        "median_paired_diff_s": statistics.median(diffs),
        "median_paired_diff_frac": statistics.median(diffs) / statistics.median(off),
        "paired_diffs_s": diffs,  # on − off per pair: their spread is the machine's noise
        "stage_block_s": block_s,
        "bookkeeping_per_step_s": block_s * blocks_per_step,
        "bookkeeping_frac_of_step": block_s * blocks_per_step / statistics.median(off),
        "machine": "shared CPU (numbers under contention)",
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Run the rlhflab-vs-TRL benchmarks and write bench/RESULTS.md and bench/results.json.

    python bench/run.py [--only NAME ...] [--reps N] [--quick] [--smoke --out DIR]

Results of benchmarks not run this time are kept from the previous results_full.json, so
`--only` re-measures some rows and leaves the others. See bench/README.md for what is timed.
`--smoke` runs every row (or the `--only` ones) once at its smallest size, to show that it runs
(the test suite's tests/bench/test_bench_smoke.py); its numbers are not results, and it writes
them to `--out` (default: a temporary directory), never to bench/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--smoke" in sys.argv[1:]:  # before bench.common reads it; the rows' subprocesses inherit it
    os.environ["RLHFLAB_BENCH_SMOKE"] = "1"

from bench import common, report
from bench.common import Pair

BENCHMARKS = [
    "grpo_noref_tiny",
    "grpo_ref_tiny",
    "grpo_noref_tiny_256",
    "grpo_step_eos_sft",
    "dpo_ref_tiny",
    "dpo_cached_tiny",
    "rm_tiny",
    "sft_tiny",
    "sft_padding_free_tiny",
    "generation_tiny",
    "generation_eos_sft",
    "generation_groups_tiny",
    "grpo_noref_smol",
    "dpo_ref_smol",
    "rm_smol",
    "generation_smol",
    "memory_49k",
    "memory_49k_ckpt",
    "learning",
]
MARK_START, MARK_END = "<!-- results:start -->", "<!-- results:end -->"


def _memory(name: str, reps: int) -> Pair:
    from bench import memory

    ckpt = name.endswith("ckpt")
    variants = ("ours", "naive") if ckpt or not common.have_trl() else memory.VARIANTS
    res = memory.run(reps=1 if ckpt else reps, checkpointing=ckpt, variants=variants)
    mib = 2**20
    inc = {v: [r["step_peak"] / mib for r in rs] for v, rs in res.items()}
    peak = {v: [r["peak"] / mib for r in rs] for v, rs in res.items()}
    s = memory.SHAPE
    return Pair(
        name,
        inc["ours"],
        inc["naive"],
        "MiB above pre-step RSS",
        target=0.6,
        note=(
            f"SmolLM2-135M shape (vocab 49152), B={s['B']} x ({s['P']} prompt + {s['T']} completion) tokens, "
            f"{'gradient checkpointing on, ' if ckpt else ''}loss + backward + AdamW step; theirs = naive full fp32 "
            "log-softmax over every position; each measurement a fresh process"
        ),
        extra={
            "absolute_peak_mib": peak,
            "step_increment_mib": inc,
            "step_s": {v: [r["step_s"] for r in rs] for v, rs in res.items()},
        },
    )


def _learning(quick: bool) -> Pair:
    from bench import learning

    lrs = [3e-4] if quick or common.SMOKE else [1e-4, 3e-4, 1e-3]
    budget = 1.0 if common.SMOKE else 30.0 if quick else 60.0
    res = learning.run(lrs=lrs, budget=budget)
    bo = res["best_ours"]
    bt = res.get("best_trl") or {"report": float("nan"), "lr": float("nan"), "steps": 0}
    return Pair(
        "learning",
        [bo["report"]],
        [bt["report"]],
        "held-out accuracy",
        higher_is_better=True,
        target=1.0,
        note=(
            f"quickstart task, same SFT start (held-out {res['sft']['report']:.3f}), GRPO for {budget:.0f} s "
            "of training each (counted from the first step's start on both sides, set-up excluded), "
            f"LR sweep {lrs}; best LR by validation: ours {bo['lr']:g} ({bo['steps']} steps), "
            f"TRL {bt['lr']:g} ({bt['steps']} steps); accuracy on {learning.N_REPORT} held-out problems "
            f"(stderr ~{bo['report_stderr']:.3f})"
        ),
        extra=res,
    )


def run_one(name: str, *, warmup: int, reps: int, quick: bool) -> Pair:
    from bench import steps

    scale = common.SMOL if name.endswith("_smol") else common.TINY
    smol_reps = max(2, reps if not quick else 1) if scale == common.SMOL else reps
    if common.SMOKE:
        smol_reps = reps
    if name == "grpo_step_eos_sft":
        return steps.grpo_eos(warmup=warmup, reps=reps)
    if name.startswith("grpo_"):
        beta = 0.04 if "_ref_" in name else 0.0
        max_new = 256 if name.endswith("_256") else None
        return steps.grpo(scale, beta=beta, warmup=warmup, reps=smol_reps, max_new=max_new)
    if name.startswith("dpo_"):
        return steps.dpo(scale, precompute="cached" in name, warmup=warmup, reps=smol_reps)
    if name.startswith("rm_"):
        return steps.reward_model(scale, warmup=warmup, reps=smol_reps)
    if name.startswith("sft_"):
        return steps.sft(scale, padding_free="padding_free" in name, warmup=warmup, reps=smol_reps)
    if name == "generation_eos_sft":
        return steps.generation_eos(warmup=warmup, reps=reps)
    if name.startswith("generation_groups_"):
        return steps.generation_groups(scale, warmup=warmup, reps=smol_reps)
    if name.startswith("generation_"):
        return steps.generation(scale, warmup=warmup, reps=smol_reps)
    if name.startswith("memory_"):
        return _memory(name, 1 if quick or common.SMOKE else 2)
    if name == "learning":
        return _learning(quick)
    raise ValueError(name)


def _load_line(results: dict) -> str:
    """The 1-minute load averages at the start and end of each row (`load_avg_1min`), if
    recorded: how idle the machine was while the rows ran."""
    loads = [x for r in results.values() for x in r.get("load_avg_1min", [])]
    if not loads:
        return "Load average: not recorded for these rows.  "
    return (
        f"Load average (1 min) at the start and end of each row: {min(loads):.2f}–{max(loads):.2f} "
        "(sampled between rows only).  "
    )


def write_results_md(path: Path, results: dict, machine: dict, command: str) -> None:
    gen = [
        MARK_START,
        f"Machine: {machine['cpu']}, {machine['cores']} cores ({machine.get('memory_gib', '?')} GiB), "
        f"torch {machine['torch']}, transformers {machine.get('transformers')}, trl {machine.get('trl')}, "
        f"Python {machine['python']}, {machine['threads']} torch thread for both frameworks, "
        f"GPU: {machine['gpu'] or 'none'}.  ",
        _load_line(results),
        f"Command: `{command}`",
        "",
        report.markdown_table(results),
        report.notes(results),
        MARK_END,
    ]
    block = "\n".join(gen)
    if path.exists() and MARK_START in path.read_text():
        text = path.read_text()
        pre, rest = text.split(MARK_START, 1)
        post = rest.split(MARK_END, 1)[1]
        path.write_text(pre + block + post)
    else:
        path.write_text("# Benchmarks: rlhflab vs TRL\n\n" + block + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=BENCHMARKS, help="run only these benchmarks")
    ap.add_argument("--reps", type=int, default=5, help="measured repetitions per benchmark")
    ap.add_argument("--quick", action="store_true", help="2 reps, smaller learning benchmark")
    ap.add_argument("--out", type=Path, default=None, help="where results go (default: bench/)")
    ap.add_argument(
        "--smoke", action="store_true", help="every row once at its smallest size (not results)"
    )
    args = ap.parse_args(argv)
    if args.smoke != common.SMOKE:
        raise SystemExit("bench/run.py: --smoke must be given on the command line (sys.argv)")
    common.setup()
    tmp = None
    if args.out is None:
        tmp = tempfile.TemporaryDirectory() if args.smoke else None
        args.out = Path(tmp.name) if tmp else common.BENCH_DIR
    reps = 1 if args.smoke else 2 if args.quick else args.reps
    warmup = 1
    names = args.only or BENCHMARKS
    full_path = args.out / "results_full.json"
    old = json.loads(full_path.read_text())["results"] if full_path.exists() else {}
    results = {k: v for k, v in old.items() if k in BENCHMARKS}
    machine = common.machine()
    for name in names:
        t0 = time.perf_counter()
        load_before = os.getloadavg()[0]  # the machine must be otherwise idle (bench/README.md)
        print(f"[bench] {name} ...", flush=True)
        pair = run_one(name, warmup=warmup, reps=reps, quick=args.quick)
        d = pair.to_dict()
        d["wall_s"] = round(time.perf_counter() - t0, 1)
        d["quick"] = args.quick
        d["load_avg_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]  # start, end
        results[name] = d
        print(
            f"[bench] {name}: ours {d['ours']['median']:.4g}  theirs {d['theirs']['median']:.4g} "
            f"{d['unit']}  ratio {d['ratio']:.3f}  target {d['target']}  met {d['met']}  ({d['wall_s']} s)",
            flush=True,
        )
        ordered = {k: results[k] for k in BENCHMARKS if k in results}
        report.write(ordered, machine, args.out)
        command = "python bench/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_results_md(args.out / "RESULTS.md", ordered, machine, command.strip())
    print(report.markdown_table({k: results[k] for k in BENCHMARKS if k in results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

# Run from the repository root after the runs of docs/distillation.md (run directories under exp/).
"""Table and plot of docs/distillation.md from the experiment runs (exp/runs, exp/qs, exp/pair)."""

import glob
import json
import math
import sys
from pathlib import Path


def run(name, root="exp/runs"):
    d = sorted(glob.glob(f"{root}/{name}-*"))
    if not d:
        return None
    d = Path(d[-1])
    fr = d / "final_results.json"
    rows = [json.loads(x) for x in Path(d / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/accuracy"], r["time_s"]) for r in rows if "eval/accuracy" in r]
    res = json.loads(fr.read_text()) if fr.exists() else None
    return {"dir": d, "res": res, "evals": evals, "rows": rows}


def first_time(evals, thr):
    return next((t for s, a, t in evals if s > 0 and a >= thr), None)


def mean_se(xs):
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, float("nan")
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)


base = 0.46
names = sys.argv[1:]
for n in names:
    r = run(n)
    if r is None or r["res"] is None:
        print(n, "missing/failed", r and r["evals"][-1:])
        continue
    res = r["res"]
    print(
        f"{n:24s} acc {res['heldout_accuracy']:.3f} ± {res['heldout_accuracy_stderr']:.3f} wall {res['wall_s']:.0f}s "
        f"steps {res['steps']} t(+15) {first_time(r['evals'], base + 0.15)} evals {[(s, a) for s, a, _ in r['evals']]}"
    )

"""The README's table from the judge-gold runs and frontier_check.py's output:

    python summarize.py CHECK_JSONL RUN_DIR [RUN_DIR ...]

Per run: frontier proxy, judge-gold (the logged frontier/gold) and verifier (frontier_check.py,
the same samples) at step 0 and at the end, √KL at the end, greedy held-out accuracy
(eval/accuracy, 200 problems); then end − start paired over seeds (mean, 95% t interval).
"""

import json
import sys
from pathlib import Path

from rlhflab.stats import paired_difference

checks = {}
for line in Path(sys.argv[1]).read_text().splitlines():
    r = json.loads(line)
    checks[r["run"]] = r
table, deltas = [], {"proxy": [], "judge": [], "verifier": [], "accuracy": []}
for arg in sys.argv[2:]:
    run = Path(arg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    front = {r["step"]: r for r in rows if "frontier/gold" in r}
    acc = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    s0, s1 = min(front), max(front)
    c = checks[run.name]
    a, b = front[s0], front[s1]
    table.append(
        f"| {run.name} | {a['frontier/proxy']:.3f} ± {a['frontier/proxy_stderr']:.3f} → "
        f"{b['frontier/proxy']:.3f} ± {b['frontier/proxy_stderr']:.3f} | "
        f"{a['frontier/gold']:.2f} ± {a['frontier/gold_stderr']:.2f} → "
        f"{b['frontier/gold']:.2f} ± {b['frontier/gold_stderr']:.2f} | "
        f"{c['step0']['verifier']:.3f} → {c['end']['verifier']:.3f} | "
        f"{b['frontier/sqrt_kl']:.2f} | {acc[s0]:.3f} → {acc[s1]:.3f} |"
    )
    deltas["proxy"].append((b["frontier/proxy"], a["frontier/proxy"]))
    deltas["judge"].append((b["frontier/gold"], a["frontier/gold"]))
    deltas["verifier"].append((c["end"]["verifier"], c["step0"]["verifier"]))
    deltas["accuracy"].append((acc[s1], acc[s0]))
    same = abs(c["end"]["judge"] - b["frontier/gold"]) < 1e-9 and abs(
        c["step0"]["judge"] - a["frontier/gold"]) < 1e-9  # fmt: skip
    print(f"{run.name}: re-measured judge equals the logged frontier/gold at both ends: {same}")
print(
    "| run | proxy (step 0 → end) | judge gold (1–10) | verifier (same samples) | √KL at end "
    "| greedy held-out accuracy |"
)
print("|---|---|---|---|---|---|")
print("\n".join(table))
for name, pairs in deltas.items():
    d = paired_difference([e for e, _ in pairs], [s for _, s in pairs])
    per = ", ".join(f"{x:+.3f}" for x in d["diffs"])
    lo = "" if d["lo"] is None else f" [{d['lo']:+.3f}, {d['hi']:+.3f}]"
    print(f"{name}: end − start mean {d['mean']:+.3f}{lo} (per seed {per})")

# Run from the repository root after the runs of docs/distillation.md (run directories under exp/).
"""docs/distillation_heldout_vs_wallclock.png: held-out greedy accuracy against wall-clock.
Left: GRPO and on-policy distillation run side by side (the same load). Right: every seed."""

import glob
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def evals(pattern):
    d = sorted(glob.glob(pattern))[0]
    rows = [json.loads(x) for x in Path(d + "/metrics.jsonl").read_text().splitlines()]
    return [(r["time_s"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]


def draw(ax, curves, title):
    for label, pat, color, ls in curves:
        pts = evals(pat)
        ax.plot(
            [t for t, _ in pts],
            [100 * a for _, a in pts],
            ls,
            color=color,
            marker="o",
            ms=3,
            label=label,
            alpha=0.9,
        )
    ax.axhline(46.0 + 15, color="gray", lw=0.8, ls=":", label="SFT + 15 points")
    ax.set_xlabel("wall-clock since the run started (s)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")


def main() -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    draw(
        a,
        [
            ("GRPO (the quickstart's stage 2)", "exp/pair/grpo_pair-20261126-083828", "k", "-"),
            ("on-policy distillation, reverse KL", "exp/pair/op_pair-*", "tab:blue", "-"),
        ],
        "run side by side, same load (2 shared cores, 1 thread each)",
    )
    curves = [("GRPO (quickstart run, made the teacher)", "exp/qs/quickstart-*/grpo-*", "k", "-")]
    for s, pat in enumerate(["exp/runs/op_s0b-*", "exp/runs/op_s1-*", "exp/runs/op_s2-*"]):
        curves.append(("on-policy distillation, 3 seeds" if s == 0 else None, pat, "tab:blue", "-"))
    for s, pat in enumerate(
        ["exp/runs/gkd_b05_l05-*", "exp/runs/gkd_b05_l05_s1-*", "exp/runs/gkd_b05_l05_s2-*"]
    ):
        curves.append(("GKD β=0.5, λ=0.5, 3 seeds" if s == 0 else None, pat, "tab:green", "--"))
    draw(b, curves, "every seed (run at different times: the load differs)")
    a.set_ylabel("held-out greedy accuracy (%)")
    fig.suptitle(
        "spell_backward: SFT model (46.0%) → distilled from the GRPO model (73.8%)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig("docs/distillation_heldout_vs_wallclock.png", dpi=100)
    print("ok")


if __name__ == "__main__":
    main()

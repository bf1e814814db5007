"""PNG plots of the main curves of a run, from its metrics rows (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

# The curves worth a picture, by family. Missing keys are skipped; a key ending in "*" matches every
# metric with that prefix (e.g. each reward component's mean); a bare "prefix*" leaves out the
# "_stderr" keys.
MAIN_CURVES: dict[str, list[str]] = {
    "reward": ["rollout/reward_mean", "rollout/reward/*_mean"],
    "accuracy": ["rollout/accuracy", "eval/accuracy", "eval/majority_baseline"],
    # a prompt dataset's held-out weighted reward and each component on its own
    "heldout_rewards": ["eval/reward", "eval/reward/*"],
    "heldout_sampling": ["eval/pass@*", "eval/maj@*"],  # pass@k / maj@k at every evaluation
    "kl": ["policy/kl", "policy/kl_ref"],
    "entropy": ["policy/entropy"],
    "response_length": ["rollout/response_len_mean"],
    "loss": ["train/loss", "policy/loss"],
}


def plot_run(
    rows: list[dict],
    out_dir: Path,
    curves: dict[str, list[str]] | None = None,
    stages: tuple[str, ...] = (),
    gold: str = "gold",
) -> list[Path]:
    """One PNG per curve group whose keys appear in `rows`; returns the files written.

    Args:
        rows: metrics rows, each with "step" and metric keys (numbers).
        out_dir: directory for the PNGs (created).
        curves: {file stem: [metric keys]}; defaults to MAIN_CURVES plus one group per held-out
            set of `eval.sets` (`eval_set_curves`: plots/eval_<set>.png).
        stages: the step's stage names (`rlhflab.throughput.STAGES`): plots/stage_split.png
            (`plot_stage_split`); () for none.
        gold: what the frontier's gold is, for plots/frontier.png (`frontier_gold_label`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if curves is None:  # one plot per further held-out set (eval.sets): eval/<set>/...
        curves = {**MAIN_CURVES, **eval_set_curves(rows)}
    for stem, keys in curves.items():
        series = {}
        for key in _expand(keys, rows):
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
            if pts:
                series[key] = pts
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
        for key, pts in series.items():
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, ms=3, label=key)
        ax.set_xlabel("step")
        ax.set_title(stem.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{stem}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    stage_plot = plot_stage_split(rows, out_dir, stages) if stages else None
    if stage_plot is not None:
        written.append(stage_plot)
    frontier = plot_frontier(rows, out_dir, gold=gold)
    if frontier is not None:
        written.append(frontier)
    return written


def plot_stage_split(
    rows: list[dict], out_dir: Path, stages: tuple[str, ...], max_bars: int = 20
) -> Path | None:
    """plots/stage_split.png: where the steps' time went, as stacked bars of the mean seconds per
    stage (`perf/<stage>_s` of each of `stages`, `rlhflab.throughput.STAGES`) over groups of consecutive logged steps
    (at most `max_bars` bars), the measured mean `perf/step_s` marked on each bar. None (nothing
    written) when no row has the stage keys (runs before issue #38, `perf.stage_timers: false`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [f"perf/{s}_s" for s in stages]
    steps = [r for r in rows if all(isinstance(r.get(k), int | float) for k in keys)]
    if not steps:
        return None
    size = -(-len(steps) // max_bars)  # ceil: steps per bar
    groups = [steps[i : i + size] for i in range(0, len(steps), size)]
    labels = [
        str(g[0]["step"]) if len(g) == 1 else f"{g[0]['step']}-{g[-1]['step']}" for g in groups
    ]
    fig, ax = plt.subplots(figsize=(max(5, 0.45 * len(groups) + 2), 3.4), dpi=100)
    bottom = [0.0] * len(groups)
    xs = range(len(groups))
    for stage, key in zip(stages, keys, strict=True):
        means = [sum(r[key] for r in g) / len(g) for g in groups]
        if not any(means):
            continue
        ax.bar(xs, means, bottom=bottom, label=stage, width=0.8)
        bottom = [b + m for b, m in zip(bottom, means, strict=True)]
    step_means = [sum(r.get("perf/step_s", 0.0) for r in g) / len(g) for g in groups]
    ax.scatter(xs, step_means, marker="_", s=200, color="black", label="perf/step_s", zorder=3)
    ax.set_xticks(list(xs), labels, rotation=45 if len(groups) > 8 else 0, fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("seconds per step (mean)")
    ax.set_title("stage split")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.tight_layout()
    path = Path(out_dir) / "stage_split.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def eval_set_curves(rows: list[dict]) -> dict[str, list[str]]:
    """{"eval_<set>": its keys} for each held-out set of `eval.sets` found in `rows` (a key
    "eval/<set>/headline"): the headline, the correctness, and each reward component."""
    sets = sorted(
        {
            k.split("/")[1]
            for r in rows
            for k in r
            if k.startswith("eval/") and k.endswith("/headline") and k.count("/") == 2
        }
    )
    return {
        f"eval_{name}": [
            f"eval/{name}/headline",
            f"eval/{name}/accuracy",
            f"eval/{name}/reward",
            f"eval/{name}/reward/*",
        ]
        for name in sets
    }


def _expand(keys: list[str], rows: list[dict]) -> list[str]:
    """`keys` with each "prefix*suffix" pattern replaced by the matching metric names, in order."""
    out: list[str] = []
    for key in keys:
        if "*" not in key:
            out.append(key)
            continue
        prefix, suffix = key.split("*", 1)
        names = {k for r in rows for k in r if k.startswith(prefix) and k.endswith(suffix)}
        if not suffix:  # "prefix*": the values, not their standard errors
            names = {k for k in names if not k.endswith("_stderr")}
        out.extend(sorted(names))
    return out


def frontier_gold_label(cfg) -> str:
    """The frontier's gold as the plot names it: "gold: <component> (eval.frontier_gold)" when a
    policy-gradient config sets `eval.frontier_gold` (e.g. an LLM judge), else "gold: verifier"
    (`rlhflab.eval.frontier`)."""
    comp = getattr(getattr(cfg, "eval", None), "frontier_gold", None)
    if comp is None:
        return "gold: verifier"
    return f"gold: {comp.label or comp.name} (eval.frontier_gold)"


def frontier_figure(rows: list[dict], gold: str = "gold"):
    """The figure of `plot_frontier` (None below two points): gold (left axis, named `gold`) and
    proxy (right axis: a judge's 1–10 and a reward model's probability need not share a scale)
    against √KL, points labelled by step."""
    pts = [r for r in rows if isinstance(r.get("frontier/sqrt_kl"), int | float)]
    if len(pts) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["frontier/sqrt_kl"] for r in pts]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    right = ax.twinx()
    g = ax.plot(x, [r["frontier/gold"] for r in pts], marker="o", color="C0", label=gold)
    p = right.plot(x, [r["frontier/proxy"] for r in pts], marker="s", color="C1",
                   label="proxy: training reward")  # fmt: skip
    for r, xi in zip(pts, x, strict=True):
        ax.annotate(str(r["step"]), (xi, r["frontier/gold"]), fontsize=7,
                    textcoords="offset points", xytext=(3, 3))  # fmt: skip
    ax.set_xlabel("√KL(π‖π_init) (nats^½ per completion), held-out samples")
    ax.set_ylabel(f"{gold}, mean score", color="C0")
    right.set_ylabel("proxy: training reward, mean", color="C1")
    ax.set_title("gold vs proxy as the run trains (points: eval steps)")
    ax.grid(alpha=0.3)
    ax.legend(handles=g + p, fontsize=8)
    fig.tight_layout()
    return fig


def plot_frontier(rows: list[dict], out_dir: Path, gold: str = "gold") -> Path | None:
    """plots/frontier.png: gold and proxy against √KL(π‖π_init) through the run's evaluations
    (`frontier/*` rows of metrics.jsonl, `rlhflab.eval.frontier`, in step order), each point
    labelled by its step, gold on the left axis (named `gold`: `frontier_gold_label`) and proxy
    on the right; None (nothing written) below two points."""
    fig = frontier_figure(rows, gold)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    path = Path(out_dir) / "frontier.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path

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
    rows: list[dict], out_dir: Path, curves: dict[str, list[str]] | None = None
) -> list[Path]:
    """One PNG per curve group whose keys appear in `rows`; returns the files written.

    Args:
        rows: metrics rows, each with "step" and metric keys (numbers).
        out_dir: directory for the PNGs (created).
        curves: {file stem: [metric keys]}; defaults to MAIN_CURVES plus one group per held-out
            set of `eval.sets` (`eval_set_curves`: plots/eval_<set>.png).
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
    return written


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

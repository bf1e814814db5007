"""R1-Zero trends (DeepSeek-AI 2025, "DeepSeek-R1", arXiv 2501.12948, §2.2) at small scale: GRPO
straight from a base model with rule-based rewards (correctness + format), and what happens to
held-out correctness, response length and the format reward over training.

    rlhflab replicate r1-zero [configs/replications/r1_zero.yaml] --out runs/r1-zero

1. Data: GSM8K rows (`{"question", "answer": "... #### n"}`): `experiment.train_path` /
   `heldout_path` (e.g. openai/gsm8k exported to JSONL), or, when unset, the synthetic
   GSM8K-format word problems of the PRM-vs-ORM replication (`prm_orm_gsm8k.synthetic_rows`),
   written to `--out`.
2. Base model (`base` stage; `experiment.policy` skips it): a model from scratch, briefly trained
   (an SFT trainer used as a tiny "pretraining": plain-text `text` rows, every token trained, no
   chat template) on the task's plain text: the RL stage's prompt text (`rl.data.template` with
   the question), a space, then the worked solution as plain lines and "The answer is n." — so
   the RL prompt is a prefix of the documents, token for token (`base_documents`). A fraction
   `experiment.format_frac` of the documents (default 0.1) is written in the `<think>…</think>
   <answer>…</answer>` form instead, as tags occur now and then in a real base model's web data:
   the format is known but rare, so the format reward starts low, not at 0 (a from-scratch model
   cannot read the instruction in the prompt, which is how a real base model finds the format).
3. RL (`rl` stage): GRPO from that base on the same prompts, rewards `math_verify` (correctness:
   math-verify equivalence of the `<answer>` content, else the last number, with GSM8K's `#### n`)
   + `think_format` (R1's format reward), equal weights, as `configs/pg/r1_zero_gsm8k.yaml`.
   Held-out greedy evaluations every `eval.every` steps: the headline "correctness (math_verify)"
   and the format reward as its own column (`eval/reward/think_format`).
Output (`--out`): `r1_zero.json` (curves and summary), `r1_zero.png` (held-out correctness and
format reward, training-rollout correctness and format reward, mean response length in tokens,
against step), the data files, `runs/`.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from pydantic import Field

from rlhflab.replications import Experiment, begin, stage


class Spec(Experiment):
    """`experiment:` of r1_zero.yaml."""

    train_path: str | None = None  # GSM8K-format rows; None: synthetic
    heldout_path: str | None = None
    n_train: int = Field(3000, ge=1)  # synthetic rows (base-model documents and RL prompts)
    n_heldout: int = Field(100, ge=1)
    format_frac: float = Field(0.1, ge=0, le=1)  # base documents in the <think>/<answer> form
    seed: int = 0
    policy: str | None = None  # a base model directory: skip the base stage


def base_document(steps: list[str], answer: str, *, tagged: bool) -> str:
    """The completion of one base-model document: the worked steps as plain lines and "The
    answer is n." (`tagged=False`), or `<think> steps </think> <answer> n </answer>`."""
    body = "\n".join(steps)
    if tagged:
        return f"<think> {body} </think> <answer> {answer} </answer>"
    return f"{body}\nThe answer is {answer}."


def base_documents(
    problems: list, template: str, *, format_frac: float, seed: int
) -> tuple[list[dict], int]:
    """The base model's training documents, one per problem, and how many are tagged.

    Each is a plain-text language-modelling row `{"text": prompt + " " + completion}`: prompt =
    `template` with `{prompt}` replaced by the question (the RL stage's prompt text, no chat
    template: a base model has seen plain text only), completion = `base_document(...)`, tagged
    with probability `format_frac` (`random.Random(seed)`). The base stage trains on every token,
    so the RL prompt's tokens are a prefix of the document's (checked by
    tests/test_replications.py for r1_zero.yaml's template).

    Args:
        problems: GSM8K `Problem`s with `entry["steps"]` (the worked lines) and `answer`.
        template: the RL stage's `data.template` (contains "{prompt}"; ends without whitespace,
            as R1's "…Assistant:" does, so the prompt's last token is the document's too).

    Raises:
        ConfigError: the template ends with whitespace (its RL prompt would end in a lone space
            token that no base document has there).
    """
    from rlhflab.errors import ConfigError

    if template != template.rstrip():
        raise ConfigError(
            "rl.data.template: ends with whitespace; end it at the last word (e.g. 'Assistant:') "
            "so the RL prompt's token boundary is the base documents' one"
        )
    rng = random.Random(seed)
    docs, tagged_n = [], 0
    for p in problems:
        tagged = rng.random() < format_frac
        tagged_n += tagged
        prompt = template.replace("{prompt}", p.question)
        completion = base_document(p.entry["steps"], p.answer, tagged=tagged)
        docs.append({"text": f"{prompt} {completion}"})
    return docs, tagged_n


def curves_from_metrics(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) series of the R1-Zero trends from a run's metrics.jsonl rows: held-out
    `correctness` (eval/headline, else eval/reward/math_verify) and `format` (eval/reward/
    think_format); training rollouts' `train_correctness`, `train_format` and `response_len`
    (mean completion tokens)."""
    keys = {
        "correctness": ("eval/headline", "eval/reward/math_verify"),
        "format": ("eval/reward/think_format",),
        "train_correctness": ("rollout/reward/math_verify_mean",),
        "train_format": ("rollout/reward/think_format_mean",),
        "response_len": ("rollout/response_len_mean",),
    }
    out: dict[str, list[tuple[int, float]]] = {}
    for name, candidates in keys.items():
        series: list[tuple[int, float]] = []
        for key in candidates:
            series = [
                (int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), int | float)
            ]
            if series:
                break
        out[name] = series
    return out


def _window_mean(series: list[tuple[int, float]], lo: int, hi: int) -> float | None:
    vals = [v for s, v in series if lo <= s <= hi]
    return sum(vals) / len(vals) if vals else None


def plot_trends(curves: dict, path: Path, *, title: str) -> None:
    """Three panels against step: correctness (held-out headline, training rollouts), format
    reward (held-out, training rollouts), mean response length (tokens, training rollouts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4), dpi=100)
    panels = [
        ("correctness (math_verify)", [("correctness", "held-out, greedy"),
                                       ("train_correctness", "training rollouts")]),
        ("format reward (think_format)", [("format", "held-out, greedy"),
                                          ("train_format", "training rollouts")]),
        ("response length (tokens)", [("response_len", "training rollouts, mean")]),
    ]  # fmt: skip
    for ax, (name, lines) in zip(axes, panels, strict=True):
        for key, label in lines:
            if curves.get(key):
                xs, ys = zip(*curves[key], strict=True)
                held = key in ("correctness", "format")
                ax.plot(xs, ys, marker="o" if held else None, ms=3, lw=1.5 if held else 0.8,
                        alpha=1.0 if held else 0.7, label=label)  # fmt: skip
        ax.set_title(name)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(spec: dict, out: Path, *, source: str) -> dict:
    """Run the replication (module doc); returns and writes r1_zero.json."""
    from rlhflab.data.gsm8k import load_gsm8k
    from rlhflab.replications.prm_orm_gsm8k import synthetic_rows
    from rlhflab.serialize import to_json, write_json_atomic
    from rlhflab.tracking import read_metrics
    from rlhflab.trainers import run_config

    exp, t0, runs = begin(Spec, spec, out, source)
    timings: dict = {}
    # The RL stage validates before anything trains (its data and start model are filled in).
    stage(spec, "rl", source, model={"name_or_path": "<base>"}, run={"root": runs},
          data={"path": "<data>", "heldout_path": "<data>"})  # fmt: skip
    template = spec["rl"]["data"].get("template") or "{prompt}"

    # 1. GSM8K-format data.
    train_path, heldout_path = exp.train_path, exp.heldout_path
    if train_path is None or heldout_path is None:
        rows = synthetic_rows(exp.n_train + 3 * exp.n_heldout, seed=exp.seed)
        train_rows = rows[: exp.n_train]
        seen = {r["question"] for r in train_rows}
        held_rows = [r for r in rows[exp.n_train :] if r["question"] not in seen]
        held_rows = held_rows[: exp.n_heldout]
        train_path, heldout_path = str(out / "gsm8k_train.jsonl"), str(out / "gsm8k_test.jsonl")
        for path, rs in ((train_path, train_rows), (heldout_path, held_rows)):
            Path(path).write_text("".join(to_json(r) + "\n" for r in rs))
    train, _ = load_gsm8k(train_path)

    # 2. The base model: brief training on plain task text (a few documents with tags).
    policy = exp.policy
    base_stats = None
    if policy is None:
        docs, tagged_n = base_documents(train, template, format_frac=exp.format_frac,
                                        seed=exp.seed)  # fmt: skip
        base_path = out / "base_documents.jsonl"
        base_path.write_text("".join(to_json(d) + "\n" for d in docs))
        base_stats = {"documents": len(docs), "tagged": tagged_n}
        base = run_config(stage(spec, "base", source, data={"source": "jsonl",
                                                            "path": str(base_path)},
                                run={"root": runs}))  # fmt: skip
        policy, timings["base_s"] = base["model_dir"], base["wall_s"]

    # 3. GRPO from the base with the R1-Zero rewards.
    rl = run_config(stage(spec, "rl", source, model={"name_or_path": policy}, run={"root": runs},
                          data={"path": train_path, "heldout_path": heldout_path}))  # fmt: skip
    timings["rl_s"] = rl["wall_s"]
    run_dir = Path(rl["run_dir"])
    curves = curves_from_metrics(read_metrics(run_dir / "metrics.jsonl"))
    steps = max((s for s, _ in curves["response_len"]), default=0)
    w = max(1, min(20, steps // 5))
    summary = {
        "heldout_correctness": {"first": curves["correctness"][0] if curves["correctness"] else None,
                                "last": curves["correctness"][-1] if curves["correctness"] else None},
        "heldout_format": {"first": curves["format"][0] if curves["format"] else None,
                           "last": curves["format"][-1] if curves["format"] else None},
        f"first_{w}_steps": {k: _window_mean(curves[k], 1, w)
                             for k in ("train_correctness", "train_format", "response_len")},
        f"last_{w}_steps": {k: _window_mean(curves[k], steps - w + 1, steps)
                            for k in ("train_correctness", "train_format", "response_len")},
    }  # fmt: skip
    plot_trends(curves, out / "r1_zero.png",
                title=f"R1-Zero trends: GRPO from a base model, GSM8K-format, "
                      f"{rl.get('heldout_n') or exp.n_heldout} held-out problems")  # fmt: skip
    results = {
        "data": {"train": train_path, "heldout": heldout_path, "train_rows": len(train),
                 "synthetic": exp.train_path is None or exp.heldout_path is None},
        "base": policy,
        "base_documents": base_stats,
        "rl_run": str(run_dir),
        "headline": rl.get("headline"),
        "summary": summary,
        "curves": curves,
        "timings": timings,
        "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    write_json_atomic(out / "r1_zero.json", results)
    return {**results, "plot": str(out / "r1_zero.png")}

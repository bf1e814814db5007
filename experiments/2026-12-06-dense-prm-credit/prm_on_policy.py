"""How well the experiment's PRM tells right from wrong steps in the start policy's own samples.

The PRM was trained and evaluated on planted errors (configs/rm/prm.yaml); GRPO shows it the
policy's own slips. This samples the SFT policy at T = 1 on held-out problems, labels every step
with the exact checker (`rlhflab.data.prm.label_steps`) and reads the PRM's P(step correct) at
each newline (`RewardModelScorer.step_probs_rollout`, what `credit: dense` rewards). Writes
prm_on_policy.json in this folder.

Usage (after run.py, from the repository root):
    python experiments/2026-12-06-dense-prm-credit/prm_on_policy.py --root runs/dense-prm-credit
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    import torch

    from rlhflab.config import load_config
    from rlhflab.data.formatting import encode_prompt, task_instruction
    from rlhflab.data.prm import label_steps
    from rlhflab.data.prompts import render_row
    from rlhflab.data.tasks import make_splits
    from rlhflab.eval.rm_metrics import auc
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.rewards.reward_model import RewardModelScorer
    from rlhflab.rollout.sampler import pack

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="runs/dense-prm-credit")
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--samples", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    root = Path(args.root)
    sft, prm = (json.loads((root / f"{n}.json").read_text()) for n in ("sft", "prm"))
    cfg = load_config(Path(sft["run_dir"]) / "config.yaml")
    t = cfg.task
    splits = make_splits(
        t.name, config=t.config, n_train=t.n_train, n_heldout=t.n_heldout, seed=t.seed
    )
    problems = splits.heldout[: args.problems]
    tok = load_tokenizer(sft["model_dir"])
    model = load_model(sft["model_dir"]).eval()
    scorer = RewardModelScorer.from_pretrained(prm["model_dir"], kind="prm")
    labels, probs, kinds = [], [], []
    n_mismatch = 0
    for p in problems:
        ids = encode_prompt(
            tok, render_row(tok, p, system=t.system, instruction=task_instruction(t))
        )
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=64, num_return_sequences=args.samples,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
        for row in out[:, len(ids) :].tolist():
            comp = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
            text = tok.decode(comp, skip_special_tokens=True)
            steps = text.split("\n")[:-1]  # a line is a step once its newline is out
            expr = p.entry["metadata"]["expression"]
            ratings = label_steps(expr, steps)
            pr, st = scorer.step_probs_rollout(pack([ids], [comp], scorer.pad_token_id))
            ps = pr[0][st[0]].tolist()
            if len(ps) != len(ratings):
                n_mismatch += 1
                continue
            exact = _exact_values(expr)
            first_error = ratings.index(-1) if -1 in ratings else None
            for j, (r, q) in enumerate(zip(ratings, ps, strict=True)):
                labels.append(r)
                probs.append(q)
                if j == first_error:  # the steps before it are right: its reference is canonical
                    kinds.append(_kind(steps[j], exact[j] if j < len(exact) else None))
    binary = [1.0 if r == 1 else 0.0 for r in labels]
    first = [(q, 1.0 if r == 1 else 0.0) for r, q in zip(labels, probs, strict=True) if r != 0]
    res = {
        "problems": len(problems),
        "samples_per_problem": args.samples,
        "steps": len(labels),
        "ratings": {str(v): labels.count(v) for v in (1, 0, -1)},
        "step_auc_binary": auc(probs, binary),
        "step_auc_correct_vs_first_error": auc([q for q, _ in first], [y for _, y in first]),
        "mean_p_correct": {
            str(v): _mean([q for r, q in zip(labels, probs, strict=True) if r == v])
            for v in (1, 0, -1)
        },
        "first_errors_by_kind": {k: kinds.count(k) for k in sorted(set(kinds))},
        "skipped_separator_mismatch": n_mismatch,
    }
    (HERE / "prm_on_policy.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


def _exact_values(expr: str) -> list[int]:
    """The canonical intermediate results of a left-to-right chained sum."""
    from rlhflab.data.prm import solve_steps

    return [int(s.split("=")[1]) for s in solve_steps(expr)]


def _kind(step: str, exact: int | None) -> str:
    """How a solution's first wrong step differs from the canonical step: its result 'off by 1'
    or 'off by more', else 'other' (operands wrong, an extra step, unparseable)."""
    try:
        got = int(step.split("=")[1])
    except (IndexError, ValueError):
        return "other"
    if exact is None:
        return "other"
    d = abs(got - exact)
    return "off by 1" if d == 1 else "off by more" if d > 1 else "other"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


if __name__ == "__main__":
    main()

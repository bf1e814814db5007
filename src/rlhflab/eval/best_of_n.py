"""Best-of-N selection with reward models, and rejection sampling into SFT data.

For each held-out problem the policy samples N_max completions once; each scorer (preference RM,
ORM, PRM) scores all of them. Accuracy at N is the verifier's verdict on the highest-scored of N
samples, averaged over problems and over `n_resamples` random subsets of size N drawn from the pool
(so the curve does not depend on one arbitrary ordering). Two references come with it:
    oracle@N  a correct sample exists among the N (pass@N, the ceiling of any selector)
    random@N  mean correctness of the N samples (what N = 1 gives in expectation)
Ties in RM score are broken by sample order within the subset (which is random).
"""

from __future__ import annotations

import os
import random

from rlhflab.eval.accuracy import mean_and_stderr
from rlhflab.rollout.sampler import pack
from rlhflab.rollout.scored import sample_and_score
from rlhflab.runs import to_json


def selection_curve(
    scores: list[list[float]],
    correct: list[list[float]],
    ns: list[int],
    *,
    n_resamples: int = 16,
    seed: int = 0,
) -> dict[int, dict[str, float]]:
    """{N: {"accuracy", "stderr", "oracle", "random"}} from per-problem sample scores and 0/1
    correctness (lists of equal length N_max per problem)."""
    rng = random.Random(seed)
    out = {}
    for n in ns:
        per_problem, oracle, rand = [], [], []
        for sc, ok in zip(scores, correct, strict=True):
            if n > len(sc):
                raise ValueError(f"best-of-{n} needs {n} samples per problem, have {len(sc)}")
            acc = orc = rnd = 0.0
            for _ in range(n_resamples):
                idx = rng.sample(range(len(sc)), n)
                best = max(idx, key=lambda i: sc[i])
                acc += ok[best]
                orc += max(ok[i] for i in idx)
                rnd += sum(ok[i] for i in idx) / n
            per_problem.append(acc / n_resamples)
            oracle.append(orc / n_resamples)
            rand.append(rnd / n_resamples)
        mean, se = mean_and_stderr(per_problem)
        out[n] = {
            "accuracy": mean,
            "stderr": se,
            "oracle": sum(oracle) / len(oracle),
            "random": sum(rand) / len(rand),
        }
    return out


def score_pool(scorer, ss, *, batch: int = 256) -> list[list[float]]:
    """Scorer scores of every sample in a `ScoredSamples` pool, per problem: a reward model's
    raw scores of the token ids, or an LLM judge's (`rlhflab.rewards.judge.JudgeScorer`, which
    reads texts: `selection_scores`, −inf where its output did not parse)."""
    judge = hasattr(scorer, "selection_scores")
    if judge:  # a judge reads the prompt and completion texts
        from rlhflab.rewards.judge import prompt_text

        prompts = [
            prompt_text(p) for p, row in zip(ss.problems, ss.texts, strict=True) for _ in row
        ]
        flat = scorer.selection_scores(prompts, [t for row in ss.texts for t in row])
    else:
        flat_p = [ss.prompt_ids[i] for i, row in enumerate(ss.completion_ids) for _ in row]
        flat_c = [c for row in ss.completion_ids for c in row]
        flat = []
        for s in range(0, len(flat_c), batch):
            ro = pack(flat_p[s : s + batch], flat_c[s : s + batch], scorer.pad_token_id)
            flat += scorer.raw_scores_rollout(ro).tolist()
    out, k = [], 0
    for row in ss.texts if judge else ss.completion_ids:  # one entry per sampled completion
        out.append(flat[k : k + len(row)])
        k += len(row)
    return out


def best_of_n_eval(
    policy,
    tokenizer,
    problems: list,
    verifier,
    scorers: dict,
    *,
    ns: list[int],
    max_new_tokens: int = 48,
    temperature: float = 1.0,
    batch_size: int = 256,
    seed: int = 0,
    system: str | None = None,
    instruction: str | None = None,
    n_resamples: int = 16,
) -> dict:
    """Sample max(ns) completions per problem, score them with every scorer, and return
    {"curves": {name: {N: {...}}}, "pool": ScoredSamples, "rm_scores": {name: [[...]]}}.
    The policy's prompts carry `system` and the answer-format `instruction` (`render_row`)."""
    ss = sample_and_score(
        policy,
        tokenizer,
        problems,
        verifier,
        k=max(ns),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        batch_size=batch_size,
        seed=seed,
        system=system,
        instruction=instruction,
    )
    correct = [[1.0 if s >= 1.0 else 0.0 for s in row] for row in ss.scores]
    curves, rm_scores = {}, {}
    for name, scorer in scorers.items():
        rm_scores[name] = score_pool(scorer, ss)
        curves[name] = selection_curve(
            rm_scores[name], correct, sorted(ns), n_resamples=n_resamples, seed=seed
        )
    return {"curves": curves, "pool": ss, "rm_scores": rm_scores}


def write_rejection_sft(
    path: str | os.PathLike[str],
    ss,
    rm_scores: list[list[float]],
    *,
    n: int | None = None,
    min_score: float | None = None,
) -> int:
    """Rejection sampling: the highest-RM-scored of the first `n` samples of each problem, written
    as JSONL rows {"prompt": question, "completion": text, "rm_score": s} that
    `rlhflab.data.sft.load_sft_jsonl` reads. Problems whose best score is below `min_score` are
    skipped. Returns the number of rows written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    rows = 0
    with open(path, "w", encoding="utf-8") as fh:
        for problem, texts, scores in zip(ss.problems, ss.texts, rm_scores, strict=True):
            k = len(texts) if n is None else min(n, len(texts))
            best = max(range(k), key=lambda i: scores[i])
            if (min_score is not None and scores[best] < min_score) or not texts[best].strip():
                continue
            if scores[best] == float("-inf"):  # a judge scored none of them
                continue
            row = {"prompt": problem.question, "completion": texts[best], "rm_score": scores[best]}
            fh.write(to_json(row) + "\n")
            rows += 1
    return rows


def plot_curves(curves: dict, path: str | os.PathLike[str], *, title: str = "best-of-N") -> None:
    """Accuracy vs N (log2 x-axis) for each scorer, with oracle and random references."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    ref = None
    for name, curve in curves.items():
        ns = sorted(curve)
        ax.errorbar(
            ns,
            [curve[n]["accuracy"] for n in ns],
            yerr=[curve[n]["stderr"] for n in ns],
            marker="o",
            capsize=3,
            label=name,
        )
        ref = curve
    if ref is not None:
        ns = sorted(ref)
        ax.plot(ns, [ref[n]["oracle"] for n in ns], "k--", label="oracle (pass@N)")
        ax.plot(ns, [ref[n]["random"] for n in ns], "k:", label="random pick")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (samples per problem)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_best_of_n_command(
    policy_path: str,
    rms: list[str],
    *,
    task: str,
    task_config: dict | None = None,
    problems: int = 64,
    exclude_train: int = 20000,
    seed: int = 0,
    ns: list[int] = (1, 2, 4, 8),
    max_new_tokens: int = 48,
    temperature: float = 1.0,
    answer_format: str = "plain",
    instruction: str = "auto",
    prm_reduce: str = "min",
    out_dir: str | None = None,
    write_sft: str | None = None,
    min_score: float | None = None,
    threads: int | None = None,
    data: dict | None = None,
    reward_fns: list[str] | None = None,
    judges: list[str] = (),
) -> dict:
    """`rlhflab best-of-n`: accuracy vs N of each `PATH:KIND` reward model on held-out problems
    (questions absent from the first `exclude_train` training items), with a plot and optionally
    the rejection-sampled SFT JSONL (selected by the first RM from samples on `problems`
    training-split problems, never held-out ones). With `data` (PromptDataConfig fields of a
    prompt dataset) the prompts come from its held-out / training rows and `reward_fns` (as
    `rlhflab eval --reward-fn`) decide what counts as correct (summed reward 1.0). Task prompts
    carry the answer-format `instruction` ("auto", "none" or a text, as `task.instruction`).
    `judges`: LLM judge model paths (`rlhflab.rewards.judge`), each a selector beside the RMs,
    scoring 1-10 with the default pointwise template and parse rule."""
    import torch

    from rlhflab.data.formatting import answer_instruction
    from rlhflab.data.tasks import make_splits
    from rlhflab.errors import ConfigError
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.rewards.reward_model import RewardModelScorer
    from rlhflab.rewards.verifier import Verifier

    if threads:
        torch.set_num_threads(threads)
    scorers = {}
    for spec in rms:
        path, _, kind = spec.rpartition(":")
        if not path or kind not in ("preference", "orm", "prm"):
            raise ConfigError(
                f"--rm: expected PATH:KIND with KIND preference|orm|prm, got {spec!r}"
            )
        name = kind if kind not in scorers else f"{kind}:{path}"
        scorers[name] = RewardModelScorer.from_pretrained(path, kind=kind, prm_reduce=prm_reduce)
    for path in judges:
        from rlhflab.rewards.judge import JudgeScorer

        name = "judge" if "judge" not in scorers else f"judge:{path}"
        scorers[name] = JudgeScorer.from_pretrained(path)
    if not scorers:
        raise ConfigError("best-of-n: give at least one --rm PATH:KIND or --judge PATH")
    if data is not None:  # a prompt dataset: "correct" means the summed reward is 1.0
        from rlhflab.config import PromptDataConfig
        from rlhflab.data.prompts import load_prompt_source
        from rlhflab.eval.common import reward_components_from_specs
        from rlhflab.rewards.shaping import TextRewardScorer

        scorer = TextRewardScorer(reward_components_from_specs(reward_fns or []))
        splits = load_prompt_source(PromptDataConfig(source="dataset", **data), seed=seed)
        splits.heldout = splits.heldout[:problems]
        prompt_instruction = None  # dataset prompts are used as they are
    else:
        prompt_instruction = answer_instruction(instruction, answer_format)
        scorer = Verifier(answer_format=answer_format)
        splits = make_splits(
            task, config=task_config or {}, n_train=exclude_train, n_heldout=problems, seed=seed
        )
    tokenizer = load_tokenizer(policy_path)
    policy = load_model(policy_path).eval()
    res = best_of_n_eval(
        policy,
        tokenizer,
        splits.heldout,
        scorer,
        scorers,
        ns=sorted(ns),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed + 1,
        instruction=prompt_instruction,
    )
    summary = {"problems": len(splits.heldout), "curves": res["curves"]}
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        plot_curves(res["curves"], os.path.join(out_dir, "best_of_n.png"))
        with open(os.path.join(out_dir, "best_of_n.json"), "w") as fh:
            fh.write(to_json(summary, indent=2) + "\n")
        summary["plot"] = os.path.join(out_dir, "best_of_n.png")
    if write_sft:
        # Rejection sampling writes training data: it draws its own pool from the TRAINING split
        # (never the held-out problems the curves are measured on).
        first = next(iter(scorers))
        train_problems = rejection_problems(splits.train, problems, seed=seed)
        pool = best_of_n_eval(
            policy,
            tokenizer,
            train_problems,
            scorer,
            {first: scorers[first]},
            ns=[max(ns)],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed + 2,
            instruction=prompt_instruction,
        )
        summary["sft_rows"] = write_rejection_sft(
            write_sft, pool["pool"], pool["rm_scores"][first], n=max(ns), min_score=min_score
        )
        summary["sft_path"] = write_sft
        summary["sft_source"] = f"training split ({len(train_problems)} problems)"
    return summary


def rejection_problems(train: list, n: int, *, seed: int) -> list:
    """`n` training problems with distinct questions, in a seeded random order: the prompts of
    rejection sampling (`--write-sft`). Raises ValueError when the training split is empty."""
    if not train:
        raise ValueError("rejection sampling needs training problems (--exclude-train > 0)")
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    out, seen = [], set()
    for i in order:
        q = train[i].question.strip()
        if q not in seen:
            seen.add(q)
            out.append(train[i])
        if len(out) == n:
            break
    return out

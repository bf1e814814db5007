"""PRM vs ORM on GSM8K-format problems (Lightman et al. 2023, "Let's Verify Step by Step", arXiv
2305.20050), with Monte-Carlo step labels from the policy's own rollouts (Math-Shepherd, Wang et al.
2024, arXiv 2312.08935), at small scale.

    rlhflab replicate prm-orm-gsm8k [configs/replications/prm_orm_gsm8k.yaml] --out runs/prm-orm

1. Data: GSM8K rows (`{"question", "answer": "... #### n"}`) read by `rlhflab.data.gsm8k.load_gsm8k`:
   `experiment.train_path` / `heldout_path` (e.g. openai/gsm8k exported to JSONL), or, when unset,
   synthetic GSM8K-format word problems (`synthetic_rows`: one quantity changed by 2–3 additions
   and subtractions, worked solutions with `<<a+b=c>>` annotations) written to `--out`.
2. Policy: SFT (`sft` stage) on the worked solutions, one step per line, then `<answer>n</answer>`;
   `experiment.policy` skips it.
3. Samples: K solutions per training question from the policy. ORM label: the final answer is
   right (GSM8K's number, compared exactly). PRM labels, Math-Shepherd's hard estimate: step k is
   good (+1) iff at least one of M completions sampled from the prefix "step_1 … step_k" reaches the
   right answer, else −1. Both RMs (`orm`, `prm` stages; `data.source: step_labelled`) train on the
   same samples for the same steps.
4. Best-of-N on held-out questions: N_max samples each; accuracy of the pick against N for the ORM,
   the PRM (min and product of step scores), majority vote over the N final answers, and a random
   pick; s.e. over problems.
Output (`--out`): `prm_orm_gsm8k.json`, `prm_orm_gsm8k.png`, the data files, `runs/`.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path

from pydantic import Field

from rlhflab.replications import Counts, Experiment, begin, stage

NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ian", "Jo"]
ITEMS = ["apples", "marbles", "stickers", "coins", "books", "shells", "cards", "pens"]


class Spec(Experiment):
    """`experiment:` of prm_orm_gsm8k.yaml."""

    train_path: str | None = None  # GSM8K-format rows; None: synthetic
    heldout_path: str | None = None
    n_train: int = Field(
        3000, ge=1
    )  # synthetic rows for SFT (questions for RM samples are their first ones)
    n_heldout: int = Field(100, ge=1)
    rm_prompts: int = Field(96, ge=1)  # training questions sampled for the RMs
    samples_per_prompt: int = Field(4, ge=1)  # K
    mc_rollouts: int = Field(4, ge=1)  # M completions per step prefix
    ns: Counts = Field(default_factory=lambda: [1, 2, 4, 8, 16])
    max_new_tokens: int = Field(48, ge=1)
    n_resamples: int = Field(16, ge=1)
    seed: int = 0
    policy: str | None = None


def synthetic_rows(n: int, *, seed: int) -> list[dict]:
    """`n` GSM8K-format rows: a person's count of an item changed 2–3 times by buying (+) or giving
    away (−), values 1..20, never negative; the answer is the worked solution with GSM8K's
    calculator annotations and `#### n` (`rlhflab.data.gsm8k.parse_gsm8k_row` reads it)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        value = rng.randint(1, 20)
        sentences, lines = [f"{name} has {value} {item}."], []
        for _ in range(rng.randint(2, 3)):
            k = rng.randint(1, 20)
            if rng.random() < 0.5 or k > value:
                sentences.append(f"{name} buys {k} more.")
                new, op = value + k, "+"
            else:
                sentences.append(f"{name} gives away {k}.")
                new, op = value - k, "-"
            lines.append(f"{value}{op}{k} = <<{value}{op}{k}={new}>>{new}")
            value = new
        question = " ".join(sentences) + f" How many {item} does {name} have now?"
        rows.append({"question": question, "answer": "\n".join(lines) + f"\n#### {value}"})
    return rows


def _final_answer(text: str) -> str | None:
    from rlhflab.rewards import extract_answer

    return extract_answer(text, answer_format="tags")


def mc_step_labels(policy, tokenizer, problems, ss, verifier, *, m: int, max_new_tokens: int,
                   seed: int, batch: int = 256) -> list[list[tuple[list[str], list[int], str, int]]]:  # fmt: skip
    """Math-Shepherd hard-estimate labels of every sampled solution in `ss` (a ScoredSamples of
    `problems`): per problem, per sample, (steps, ratings ±1, final text, outcome 0/1). Step k
    (the k-th newline-terminated line) is +1 iff one of `m` continuations sampled after the
    prefix ending with that line's newline reaches a right answer. Text after the last newline is
    the final (the answer line), not a step."""
    import torch

    from rlhflab.rollout.engines import SamplingParams, make_engine
    from rlhflab.rollout.sampler import decode_completions

    sep_id = tokenizer("\n", add_special_tokens=False)["input_ids"]
    sep_id = sep_id[0] if len(sep_id) == 1 else None
    engine = make_engine(None, policy, tokenizer)
    params = SamplingParams(n=m, max_new_tokens=max_new_tokens, temperature=1.0)
    gen = torch.Generator().manual_seed(seed)
    jobs = []  # (problem index, sample index, step index, prefix ids, prefix text)
    parsed = []
    for i, (pids, rows) in enumerate(zip(ss.prompt_ids, ss.completion_ids, strict=True)):
        per = []
        for j, c in enumerate(rows):
            cut = [k for k, t in enumerate(c) if t == sep_id]
            text = ss.texts[i][j]
            steps = text.split("\n")
            final, steps = steps[-1], steps[:-1]
            ok = int(ss.scores[i][j] >= 1.0)
            if not steps or len(cut) != len(steps) or any(not s.strip() for s in steps):
                per.append(None)  # no step, or the newlines did not decode 1:1: dropped
                continue
            per.append([steps, [0] * len(steps), final, ok])
            for k, pos in enumerate(cut):
                jobs.append(
                    (i, j, k, list(pids) + list(c[: pos + 1]), "\n".join(steps[: k + 1]) + "\n")
                )
        parsed.append(per)
    per_chunk = max(1, batch // m)
    for s in range(0, len(jobs), per_chunk):
        chunk = jobs[s : s + per_chunk]
        ro = engine.generate([jb[3] for jb in chunk], params, generator=gen)
        texts = decode_completions(tokenizer, ro, engine.stop_token_ids)
        full = [chunk[q // m][4] + texts[q] for q in range(len(texts))]
        scores = verifier.score_batch(full, [problems[chunk[q // m][0]] for q in range(len(texts))])
        for q0, (i, j, k, _, _) in enumerate(chunk):
            good = any(sc >= 1.0 for sc in scores[q0 * m : (q0 + 1) * m])
            parsed[i][j][1][k] = 1 if good else -1
    return parsed


def majority_curve(answers: list[list[str | None]], correct: list[list[float]], ns: list[int], *,
                   n_resamples: int, seed: int) -> dict[int, dict[str, float]]:  # fmt: skip
    """Majority vote (self-consistency, Wang et al. 2022) over N of each problem's pool: the most
    common final answer among N random samples (ties: the first of them in the subset order;
    no answer never wins), counted right when a sample with that answer is right. Mean over
    `n_resamples` subsets; s.e. over problems."""
    from rlhflab.eval.accuracy import mean_and_stderr

    rng = random.Random(seed)
    out = {}
    for n in ns:
        per_problem = []
        for ans, ok in zip(answers, correct, strict=True):
            acc = 0.0
            for _ in range(n_resamples):
                idx = rng.sample(range(len(ans)), n)
                votes = Counter(ans[i] for i in idx if ans[i] is not None)
                if votes:
                    top = max(votes.values())
                    winner = next(
                        ans[i] for i in idx if ans[i] is not None and votes[ans[i]] == top
                    )
                    acc += next(ok[i] for i in idx if ans[i] == winner)
            per_problem.append(acc / n_resamples)
        mean, se = mean_and_stderr(per_problem)
        out[n] = {"accuracy": mean, "stderr": se}
    return out


def run(spec: dict, out: Path, *, source: str) -> dict:
    """Run the replication (module doc); returns and writes prm_orm_gsm8k.json."""

    from rlhflab.data.gsm8k import load_gsm8k
    from rlhflab.eval.best_of_n import best_of_n_eval, plot_curves
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.rewards.reward_model import RewardModelScorer
    from rlhflab.rewards.verifier import Verifier
    from rlhflab.rollout.scored import sample_and_score
    from rlhflab.serialize import to_json, write_json_atomic
    from rlhflab.trainers import run_config

    exp, t0, runs = begin(Spec, spec, out, source)
    timings: dict = {}

    # 1. GSM8K-format data through load_gsm8k.
    train_path, heldout_path = exp.train_path, exp.heldout_path
    if train_path is None or heldout_path is None:
        rows = synthetic_rows(exp.n_train + 3 * exp.n_heldout, seed=exp.seed)
        seen, train_rows, held_rows = set(), [], []
        for r in rows:
            (train_rows if len(train_rows) < exp.n_train else held_rows).append(r)
        seen = {r["question"] for r in train_rows}
        held_rows = [r for r in held_rows if r["question"] not in seen][: exp.n_heldout]
        train_path, heldout_path = str(out / "gsm8k_train.jsonl"), str(out / "gsm8k_test.jsonl")
        for path, rs in ((train_path, train_rows), (heldout_path, held_rows)):
            Path(path).write_text("".join(to_json(r) + "\n" for r in rs))
    train, _ = load_gsm8k(train_path)
    heldout, _ = load_gsm8k(heldout_path, limit=exp.n_heldout)
    train_q = {p.question for p in train}
    heldout = [p for p in heldout if p.question not in train_q]

    # 2. Policy: SFT on the worked solutions.
    placeholder = {"model": {"name_or_path": "<policy>"}, "run": {"root": runs},
                   "data": {"path": "<data>"}}  # fmt: skip
    stage(spec, "orm", source, **placeholder)
    stage(spec, "prm", source, **placeholder)
    policy = exp.policy
    if policy is None:
        sft_path = out / "sft_worked_solutions.jsonl"
        sft_path.write_text("".join(
            to_json({"prompt": p.question,
                     "completion": "\n".join(p.entry["steps"]) + f"\n<answer>{p.answer}</answer>"}) + "\n"
            for p in train
        ))  # fmt: skip
        sft = run_config(stage(spec, "sft", source, data={"source": "jsonl", "path": str(sft_path)},
                               run={"root": runs}))  # fmt: skip
        policy, timings["sft_s"] = sft["model_dir"], sft["wall_s"]
    tokenizer, model = load_tokenizer(policy), load_model(policy).eval()
    verifier = Verifier(answer_format="tags")

    # 3. Samples, outcome and Monte-Carlo step labels.
    t1 = time.perf_counter()
    rm_problems = train[: exp.rm_prompts]
    ss = sample_and_score(model, tokenizer, rm_problems, verifier, k=exp.samples_per_prompt,
                          max_new_tokens=exp.max_new_tokens, seed=exp.seed + 1)  # fmt: skip
    labelled = mc_step_labels(model, tokenizer, rm_problems, ss, verifier, m=exp.mc_rollouts,
                              max_new_tokens=exp.max_new_tokens, seed=exp.seed + 2)  # fmt: skip
    rows, dropped = [], 0
    for p, per in zip(rm_problems, labelled, strict=True):
        for item in per:
            if item is None:
                dropped += 1
                continue
            steps, ratings, final, ok = item
            rows.append({"prompt": p.question, "steps": steps, "ratings": ratings, "final": final,
                         "outcome": ok})  # fmt: skip
    random.Random(exp.seed).shuffle(rows)
    data_path = out / "step_labelled.jsonl"
    data_path.write_text("".join(to_json(r) + "\n" for r in rows))
    n_steps = sum(len(r["ratings"]) for r in rows)
    label_stats = {
        "solutions": len(rows),
        "dropped": dropped,
        "sample_accuracy": sum(r["outcome"] for r in rows) / max(1, len(rows)),
        "steps": n_steps,
        "steps_good": sum(x == 1 for r in rows for x in r["ratings"]) / max(1, n_steps),
        # a right final answer whose MC labels still call some step bad, and the reverse
        "right_with_a_bad_step": sum(r["outcome"] == 1 and -1 in r["ratings"] for r in rows),
        "wrong_with_all_steps_good": sum(
            r["outcome"] == 0 and -1 not in r["ratings"] for r in rows
        ),
    }
    timings["samples_and_mc_labels_s"] = round(time.perf_counter() - t1, 2)

    # 4. ORM and PRM on the same samples.
    rms = {}
    for kind in ("orm", "prm"):
        res = run_config(stage(spec, kind, source, model={"name_or_path": policy},
                               data={"source": "step_labelled", "path": str(data_path)},
                               run={"root": runs}))  # fmt: skip
        rms[kind], timings[f"{kind}_s"] = res, res["wall_s"]

    # 5. Best-of-N on held-out questions.
    t2 = time.perf_counter()
    scorers = {
        "ORM": RewardModelScorer.from_pretrained(rms["orm"]["model_dir"], kind="orm"),
        "PRM (min)": RewardModelScorer.from_pretrained(rms["prm"]["model_dir"], kind="prm",
                                                       prm_reduce="min"),
        "PRM (product)": RewardModelScorer.from_pretrained(rms["prm"]["model_dir"], kind="prm",
                                                           prm_reduce="prod"),
    }  # fmt: skip
    ns = sorted(exp.ns)
    bon = best_of_n_eval(model, tokenizer, heldout, verifier, scorers, ns=ns,
                         max_new_tokens=exp.max_new_tokens, seed=exp.seed + 12345,
                         n_resamples=exp.n_resamples)  # fmt: skip
    pool = bon["pool"]
    correct = [[1.0 if s >= 1.0 else 0.0 for s in row] for row in pool.scores]
    answers = [[_final_answer(t) for t in row] for row in pool.texts]
    curves = bon["curves"]
    majority = majority_curve(answers, correct, ns, n_resamples=exp.n_resamples,
                              seed=exp.seed + 12345)  # fmt: skip
    first = next(iter(curves.values()))
    curves["majority vote"] = {n: {**majority[n], "oracle": first[n]["oracle"],
                                   "random": first[n]["random"]} for n in ns}  # fmt: skip
    from rlhflab.eval.accuracy import mean_and_stderr

    rand, rand_se = mean_and_stderr([sum(row) / len(row) for row in correct])
    curves["random pick"] = {n: {"accuracy": rand, "stderr": rand_se, "oracle": first[n]["oracle"],
                                 "random": rand} for n in ns}  # fmt: skip
    timings["best_of_n_s"] = round(time.perf_counter() - t2, 2)
    plot_curves(curves, out / "prm_orm_gsm8k.png",
                title=f"PRM vs ORM, GSM8K-format, {len(heldout)} held-out problems")  # fmt: skip
    results = {
        "data": {
            "train": train_path,
            "heldout": heldout_path,
            "train_rows": len(train),
            "heldout_problems": len(heldout),
            "synthetic": exp.train_path is None or exp.heldout_path is None,
        },
        "policy": policy,
        "rm_data": {
            "prompts": len(rm_problems),
            "samples_per_prompt": exp.samples_per_prompt,
            "mc_rollouts": exp.mc_rollouts,
            **label_stats,
        },
        "rm_eval": {k: r.get("eval") for k, r in rms.items()},
        "curves": curves,
        "timings": timings,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    write_json_atomic(out / "prm_orm_gsm8k.json", results)
    return {**results, "plot": str(out / "prm_orm_gsm8k.png")}

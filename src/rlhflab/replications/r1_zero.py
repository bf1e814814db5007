"""R1-Zero trends (DeepSeek-AI 2025, "DeepSeek-R1", arXiv 2501.12948, §2.2) at CPU scale: GRPO
straight from a base model with rule-based rewards raises held-out correctness *and* the mean
response length together — on a task and base where longer reasoning buys accuracy.

    rlhflab replicate r1-zero [configs/replications/r1_zero.yaml] --out runs/r1-zero

1. Task (`prepare`): chains of 3–4 one-digit numbers and operations (`experiment.ops`, a subset
   of +, -, *; the default config: sums) applied left to right modulo 10 (`chain_problems`), e.g.
   `7+3*2-4 mod 10` = 6; the held-out problems are questions absent from the training set.
2. Base model, one shared by every seed (`experiment.shared_base`, the default; false: one per
   seed), built by the first cell that needs it, under a file lock, so `--only i/N` shares never
   train one twice; each seed evaluates it with its own sampling draws: a tiny model from scratch
   trained on plain-text documents (no chat template; the RL prompt is a prefix of each
   document) in which
   every problem is answered in one of two styles, both in R1's `<think>…</think><answer>…</answer>`
   form (so the format reward is satisfied by either):
       short  (in the head)  `<think> </think> <answer> 6 </answer>`
       worked (step by step) `<think> 7+3=0 0*2=0 0-4=6 </think> <answer> 6 </answer>`
   with the short style the majority (`experiment.worked_frac` of the documents are worked).
   The precondition — the worked style is the more accurate and the longer one — is designed
   into the documents: a short document's answer is a wrong guess (the right one ± 1..3 modulo
   10, `wrong_guess`) with probability `experiment.short_error`, a worked one is always right, as
   answers given "in the head" are less reliable than worked ones in the text real base models
   read. (Without it the base did not oblige: on mixed +, -, * its two styles were both near
   chance, on sums its short answers were the more accurate at T = 1.) It is measured on the
   base, not assumed: held-out samples at T = 1, correctness by style (`style_of`).
3. RL, one cell per seed × arm (`experiment.arms`, each replacing whole sections of the `rl`
   stage):
   `grpo` (correctness + format reward, group z-score advantage, GRPO's per-sequence token mean),
   `dr_grpo` (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783: group-mean advantage and
   `seq_mean_token_sum_norm`, a constant normaliser; the control for GRPO's length bias),
   `no_format` (correctness reward alone). Held-out evaluation (`evaluate_policy`) of the base and
   of the checkpoints: pass@1 over `experiment.k` samples at T = 1, greedy correctness, mean
   response length (tokens, EOS counted) overall and split by correct / incorrect samples, the
   share of each style and the correctness within it.
4. Report (`report`): the pre-registered `CRITERION` on the `grpo` arm (final − base, paired
   over seeds, Student t 95% interval), the two controls as the `SECONDARY` criterion, the
   precondition with its interval, a plot of correctness and length against step per arm.
"""

from __future__ import annotations

import fcntl
import json
import random
import re
import time
from pathlib import Path
from typing import Literal

from pydantic import Field

from rlhflab.replications.common import Experiment, check_experiment, stage
from rlhflab.replications.verdict import (
    Check,
    Criterion,
    format_interval,
    judge,
    t_interval,
    verdict_table,
)

CRITERION = Criterion(
    claim="GRPO straight from a base model with rule-based rewards (correctness + format) raises "
    "accuracy and, at the same time, the average response length: the model learns to solve "
    "problems with more thinking (DeepSeek-R1, arXiv 2501.12948, §2.2, Fig. 2 and Fig. 3)",
    checks=(
        Check("correctness_gain", "GRPO arm: held-out pass@1 (T = 1), final − base, mean over "
              "seeds (paired t interval)", above=0.0),
        Check("length_gain", "GRPO arm: held-out mean response length (tokens, samples at "
              "T = 1), final − base, mean over seeds (paired t interval)", above=0.0),
    ),
)  # fmt: skip

SECONDARY = Criterion(
    claim="the joint rise is neither GRPO's length bias (Dr. GRPO, Liu et al. 2025, arXiv "
    "2503.20783, §3.2, removes it) nor the format reward's doing (correctness reward alone)",
    checks=(
        Check("dr_grpo_correctness_gain", "Dr. GRPO arm: held-out pass@1, final − base", above=0.0),
        Check("dr_grpo_length_gain", "Dr. GRPO arm: mean response length, final − base",
              above=0.0),
        Check("no_format_correctness_gain", "no-format-reward arm: held-out pass@1, final − base",
              above=0.0),
        Check("no_format_length_gain", "no-format-reward arm: mean response length, final − base",
              above=0.0),
    ),
)  # fmt: skip

#: the arm the pre-registered criterion is judged on
MAIN_ARM = "grpo"
STYLES = ("short", "worked", "other")


class Spec(Experiment):
    """`experiment:` of r1_zero.yaml."""

    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    # arm name -> whole sections of the `rl` stage it replaces (e.g. `loss`, `reward`)
    arms: dict[str, dict] = Field(default_factory=lambda: {"grpo": {}})
    n_train: int = Field(4000, ge=1)  # training problems (base documents and RL prompts)
    n_heldout: int = Field(200, ge=2)
    terms: tuple[int, int] = (3, 5)  # numbers per problem, inclusive range
    max_term: int = Field(9, ge=1)  # each number in 1..max_term
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-", "*"], min_length=1)
    worked_frac: float = Field(0.25, ge=0, le=1)  # base documents in the worked style
    # short-style base documents whose answer is a wrong guess (worked ones are always right)
    short_error: float = Field(0.0, ge=0, le=1)
    # one base model for every seed (trained once, from the `base` stage's seed; each seed
    # evaluates it with its own sampling draws), or false: one base per seed
    shared_base: bool = True
    k: int = Field(4, ge=1)  # held-out samples per problem at T = 1 (pass@1 over k)
    eval_max_new_tokens: int = Field(48, ge=1)
    eval_steps: list[int] = Field(default_factory=list)  # RL checkpoints evaluated besides the end
    data_seed: int = 0


# ---------------------------------------------------------------------------------------------
# Task, documents, styles


#: the operations of a chain, applied left to right modulo 10
OPS = {"+": lambda a, b: (a + b) % 10, "-": lambda a, b: (a - b) % 10, "*": lambda a, b: a * b % 10}


def chain_problems(n: int, *, terms: tuple[int, int], max_term: int, seed: int,
                   ops: tuple[str, ...] | list[str] = tuple(OPS)) -> list[dict]:  # fmt: skip
    """`n` chains `{"question": "7+3*2-4 mod 10", "answer": "6", "terms": [7, "+", 3, "*", 2, "-",
    4]}`: numbers and operations (uniform over `ops`, a subset of +, -, *) applied left to right
    modulo 10 (((7+3)*2-4) mod 10), with a number of numbers uniform in `terms` (inclusive), each
    uniform in 1..`max_term` (`random.Random(seed)`); questions may repeat."""
    rng = random.Random(seed)
    ops = list(ops)
    rows = []
    for _ in range(n):
        k = rng.randint(*terms)
        chain: list = [rng.randint(1, max_term)]
        for _ in range(k - 1):
            chain += [rng.choice(ops), rng.randint(1, max_term)]
        rows.append({"question": "".join(map(str, chain)) + " mod 10",
                     "answer": str(evaluate_chain(chain)), "terms": chain})  # fmt: skip
    return rows


def evaluate_chain(chain: list) -> int:
    """A chain's value, operations left to right modulo 10: [7, "+", 3, "*", 2] -> 0."""
    acc = chain[0] % 10
    for op, x in zip(chain[1::2], chain[2::2], strict=True):
        acc = OPS[op](acc, x)
    return acc


def split_problems(spec: Spec) -> tuple[list[dict], list[dict]]:
    """The training problems and the held-out ones (distinct questions absent from training)."""
    rows = chain_problems(spec.n_train + 20 * spec.n_heldout, terms=spec.terms,
                          max_term=spec.max_term, seed=spec.data_seed, ops=spec.ops)  # fmt: skip
    train = rows[: spec.n_train]
    seen = {r["question"] for r in train}
    held: list[dict] = []
    for r in rows[spec.n_train :]:
        if r["question"] not in seen:
            seen.add(r["question"])
            held.append(r)
        if len(held) == spec.n_heldout:
            return train, held
    raise ValueError(
        f"experiment: only {len(held)} held-out questions absent from training exist for "
        f"terms {spec.terms}, max_term {spec.max_term}; lower n_heldout or n_train"
    )


def worked_steps(chain: list) -> str:
    """The worked solution: one step per operation, `a op b=c` with `a` the running value (the
    first number, then the previous step's result) and `b` the chain's next number, each step's
    operands written right before its result: [7, "+", 3, "*", 2, "-", 4] -> "7+3=0 0*2=0 0-4=6"
    (modulo 10). A tiny model adds two digits it has just written far more easily than two read
    many tokens back."""
    acc, steps = chain[0] % 10, []
    for op, x in zip(chain[1::2], chain[2::2], strict=True):
        new = OPS[op](acc, x)
        steps.append(f"{acc}{op}{x}={new}")
        acc = new
    return " ".join(steps)


def completion(chain: list, *, worked: bool, answer: int | None = None) -> str:
    """A document's answer in R1's format: the worked style `<think> 7+3=0 0*2=0 </think> <answer> 0
    </answer>` or the short one `<think> </think> <answer> 0 </answer>` (for 7+3*2); `answer`
    replaces the chain's value in a short completion (a wrong guess), never in a worked one."""
    if worked:
        return f"<think> {worked_steps(chain)} </think> <answer> {evaluate_chain(chain)} </answer>"
    value = evaluate_chain(chain) if answer is None else answer
    return f"<think> </think> <answer> {value} </answer>"


def wrong_guess(value: int, rng: random.Random) -> int:
    """A wrong one-digit answer near `value`: `value` ± 1..3 modulo 10 (offset uniform over the
    six choices), never `value` itself."""
    return (value + rng.choice([-3, -2, -1, 1, 2, 3])) % 10


def base_documents(problems: list[dict], template: str, *, worked_frac: float, seed: int,
                   short_error: float = 0.0) -> tuple[list[dict], dict]:  # fmt: skip
    """The base model's documents `{"text": prompt + " " + completion}`, one per problem, and
    their counts `{"documents", "worked", "short", "short_wrong"}`: prompt = `template` with
    `{prompt}` replaced by the question (the RL stage's prompt text: no chat template, a base
    model has seen plain text), the completion worked with probability `worked_frac`
    (`random.Random(seed)`), else short; a short completion's answer is a wrong guess
    (`wrong_guess`) with probability `short_error`, a worked one is always right. This is the
    designed precondition: answers written "in the head" are less reliable than worked ones, as
    in the text real base models read. The base stage trains on every token, so the RL prompt's
    tokens are a prefix of the document's (checked by a test).

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
    docs, counts = [], {"documents": len(problems), "worked": 0, "short": 0, "short_wrong": 0}
    for p in problems:
        worked = rng.random() < worked_frac
        wrong = not worked and rng.random() < short_error
        counts["worked" if worked else "short"] += 1
        counts["short_wrong"] += wrong
        answer = wrong_guess(evaluate_chain(p["terms"]), rng) if wrong else None
        prompt = template.replace("{prompt}", p["question"])
        docs.append({"text": f"{prompt} {completion(p['terms'], worked=worked, answer=answer)}"})
    return docs, counts


_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def style_of(text: str) -> str:
    """The answer style of a completion: "short" (an empty think block), "worked" (a think block
    with at least one `=`), or "other" (no think block, or one with text but no step)."""
    m = _THINK.search(text)
    if m is None:
        return "other"
    body = m.group(1).strip()
    if not body:
        return "short"
    return "worked" if "=" in body else "other"


# ---------------------------------------------------------------------------------------------
# Held-out evaluation


def evaluate_policy(model_dir: str, problems: list[dict], template: str, *, k: int,
                    max_new_tokens: int, seed: int) -> dict:  # fmt: skip
    """Held-out numbers of the model in `model_dir` on `problems` (rows with question/answer).

    Greedy completions and `k` samples per problem at temperature 1 (`torch.Generator` seeded
    with `seed`), scored by `exact_match` (the `<answer>` content equals the gold integer).

    Returns:
        {"greedy", "pass1": mean correctness (greedy completions; samples, = pass@1 over k),
         "len", "greedy_len": mean completion length in tokens (EOS counted; samples / greedy),
         "len_correct", "len_incorrect": mean sample length of right / wrong samples (None when
         there is none), "format": share of samples think_format rewards,
         "style_frac": {style: share of samples}, "style_acc": {style: correctness within it or
         None}, "style_n": {style: samples}, "greedy_style_frac", "n", "k"}.
    """
    import torch

    from rlhflab.data.formatting import encode_prompt
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.rewards.functions import exact_match, think_format
    from rlhflab.rollout.engines import SamplingParams, make_engine, sample_chunks

    model, tok = load_model(model_dir), load_tokenizer(model_dir)
    model.eval()
    prompts = [encode_prompt(tok, template.replace("{prompt}", p["question"])) for p in problems]
    golds = [p["answer"] for p in problems]
    engine = make_engine(None, model, tok)

    def run(params, golds_rep, generator=None):
        [(_, ro, texts)] = sample_chunks(model, engine, tok, prompts, params, generator=generator)
        right = exact_match(None, texts, answer=golds_rep)
        return texts, [float(r) for r in right], [int(n) for n in ro.lengths.tolist()]

    with torch.no_grad():
        g_texts, g_right, g_len = run(SamplingParams(max_new_tokens=max_new_tokens, greedy=True),
                                      golds)  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        s_golds = [g for g in golds for _ in range(k)]
        s_texts, s_right, s_len = run(
            SamplingParams(n=k, max_new_tokens=max_new_tokens, temperature=1.0), s_golds, gen
        )
    styles = [style_of(t) for t in s_texts]
    fmt = think_format(None, s_texts)
    return summarize_samples(s_right, s_len, styles, fmt, g_right, g_len,
                             [style_of(t) for t in g_texts], k=k)  # fmt: skip


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize_samples(right: list[float], lengths: list[int], styles: list[str],
                      fmt: list[float], greedy_right: list[float], greedy_len: list[int],
                      greedy_styles: list[str], *, k: int) -> dict:  # fmt: skip
    """The numbers of `evaluate_policy` from per-sample lists (samples problem-major, `k` per
    problem) and per-problem greedy lists."""
    out = {
        "n": len(greedy_right),
        "k": k,
        "pass1": _mean(right),
        "greedy": _mean(greedy_right),
        "len": _mean(lengths),
        "greedy_len": _mean(greedy_len),
        "len_correct": _mean([n for n, r in zip(lengths, right, strict=True) if r == 1.0]),
        "len_incorrect": _mean([n for n, r in zip(lengths, right, strict=True) if r != 1.0]),
        "format": _mean(fmt),
        "style_n": {s: styles.count(s) for s in STYLES},
        "style_frac": {s: styles.count(s) / len(styles) for s in STYLES},
        "style_acc": {
            s: _mean([r for r, st in zip(right, styles, strict=True) if st == s]) for s in STYLES
        },
        "style_len": {
            s: _mean([n for n, st in zip(lengths, styles, strict=True) if st == s]) for s in STYLES
        },
        "greedy_style_frac": {s: greedy_styles.count(s) / len(greedy_styles) for s in STYLES},
    }
    return out


# ---------------------------------------------------------------------------------------------
# The cell protocol


def _spec(spec: dict, source: str) -> Spec:
    return check_experiment(Spec, spec.get("experiment"), source)


def _template(spec: dict) -> str:
    return spec["rl"]["data"].get("template") or "{prompt}"


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def arm_spec(spec: dict, exp: Spec, arm: str) -> dict:
    """`{"rl": ...}`: the `rl` stage with the sections `experiment.arms[arm]` names replaced whole
    (not merged: an arm's `loss` is the complete loss section it runs)."""
    return {"rl": {**spec["rl"], **exp.arms[arm]}}


def cells(spec: dict, source: str) -> list[str]:
    """One cell per seed × arm, seed-major: "seed0-grpo", "seed0-dr_grpo", ..."""
    exp = _spec(spec, source)
    if MAIN_ARM not in exp.arms:
        from rlhflab.errors import ConfigError

        raise ConfigError(
            f"{source}: experiment.arms: needs the '{MAIN_ARM}' arm (the criterion's)"
        )
    return [f"seed{s}-{arm}" for s in exp.seeds for arm in exp.arms]


def prepare(spec: dict, out: Path, source: str) -> None:
    """The data every cell shares: train.jsonl and heldout.jsonl, and each seed's base documents
    (deterministic: the same files whichever share writes them). Validates the stages first."""
    from rlhflab.serialize import to_json

    exp = _spec(spec, source)
    out.mkdir(parents=True, exist_ok=True)
    runs = str(out / "runs")
    stage(spec, "base", source, data={"source": "jsonl", "path": "<docs>"}, run={"root": runs})
    for arm in exp.arms:
        stage(arm_spec(spec, exp, arm), "rl", f"{source} (arm {arm})",
              model={"name_or_path": "<base>"}, run={"root": runs},
              data={"path": "<data>", "heldout_path": "<data>"})  # fmt: skip
    train, held = split_problems(exp)
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", held)):
        (out / name).write_text("".join(to_json(r) + "\n" for r in rows))
    for key, seed in base_keys(spec, exp).items():
        docs, counts = base_documents(train, _template(spec), worked_frac=exp.worked_frac,
                                      seed=seed, short_error=exp.short_error)  # fmt: skip
        (out / f"base_documents_{key}.jsonl").write_text("".join(to_json(d) + "\n" for d in docs))
        (out / f"base_documents_{key}.json").write_text(json.dumps(counts))


def base_of(spec: dict, exp: Spec, seed: int) -> tuple[str, int]:
    """The base model RL seed `seed` starts from: (its name, the seed of its documents' draw and
    of its stage): ("shared", the `base` stage's seed) with `experiment.shared_base`, else
    ("seed<seed>", seed)."""
    if exp.shared_base:
        return "shared", int(spec["base"].get("seed", 0))
    return f"seed{seed}", seed


def base_keys(spec: dict, exp: Spec) -> dict[str, int]:
    """The base models to train, name -> seed (`base_of` over the seeds, once each)."""
    return dict(base_of(spec, exp, s) for s in exp.seeds)


def _locked_once(out: Path, name: str, build) -> dict:
    """`bases/<name>.json`, written by `build()` by whichever cell asks first (a file lock makes
    the others wait, then read it)."""
    from rlhflab.serialize import write_json_atomic

    done = out / "bases" / f"{name}.json"
    done.parent.mkdir(parents=True, exist_ok=True)
    with open(out / "bases" / f".{name}.lock", "w") as fd:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if done.is_file():
            return json.loads(done.read_text())
        result = build()
        write_json_atomic(done, result)
        return result


def _base(spec: dict, seed: int, out: Path, source: str) -> dict:
    """Seed `seed`'s base model (the shared one, or its own) and that seed's held-out evaluation
    of it (sampling draws seeded with `seed`): `bases/seed<seed>.json`, built once per output
    directory; the model itself once per `base_keys` entry (`bases/model-<key>.json`)."""
    from rlhflab.trainers import run_config

    exp = _spec(spec, source)
    key, base_seed = base_of(spec, exp, seed)

    def train() -> dict:
        t0 = time.perf_counter()
        res = run_config(stage(spec, "base", source, seed=base_seed,
                               data={"source": "jsonl",
                                     "path": str(out / f"base_documents_{key}.jsonl")},
                               run={"root": str(out / "runs"), "name": f"base-{key}"}))  # fmt: skip
        docs = json.loads((out / f"base_documents_{key}.json").read_text())
        return {"key": key, "seed": base_seed, "model_dir": res["model_dir"], "documents": docs,
                "train_s": round(time.perf_counter() - t0, 1)}  # fmt: skip

    def evaluate() -> dict:
        model = _locked_once(out, f"model-{key}", train)
        t0 = time.perf_counter()
        held = _read_jsonl(out / "heldout.jsonl")
        ev = evaluate_policy(model["model_dir"], held, _template(spec), k=exp.k,
                             max_new_tokens=exp.eval_max_new_tokens, seed=seed)  # fmt: skip
        return {"seed": seed, "base": key, "base_seed": base_seed, "model_dir": model["model_dir"],
                "documents": model["documents"], "eval": ev, "train_s": model["train_s"],
                "eval_s": round(time.perf_counter() - t0, 1)}  # fmt: skip

    return _locked_once(out, f"seed{seed}", evaluate)


def run_cell(spec: dict, cell: str, out: Path, source: str) -> dict:
    """One seed × arm: the seed's base (trained here if no other cell has), GRPO from it with the
    arm's changes, and the held-out evaluation of its checkpoints and final model."""
    import torch

    from rlhflab.trainers import run_config

    exp = _spec(spec, source)
    if exp.threads:
        torch.set_num_threads(exp.threads)
    seed_part, arm = cell.split("-", 1)
    seed = int(seed_part.removeprefix("seed"))
    base = _base(spec, seed, out, source)
    t0 = time.perf_counter()
    cfg = stage(arm_spec(spec, exp, arm), "rl", source, seed=seed, model={"name_or_path": base["model_dir"]},
                run={"root": str(out / "runs"), "name": f"rl-{cell}"},
                data={"path": str(out / "train.jsonl"),
                      "heldout_path": str(out / "heldout.jsonl")})  # fmt: skip
    steps = cfg.train.steps
    rl = run_config(cfg)
    rl_s = time.perf_counter() - t0
    run_dir = Path(rl["run_dir"])
    held = _read_jsonl(out / "heldout.jsonl")
    evals = {0: base["eval"]}
    for s in sorted(set(exp.eval_steps) - {0, steps}):
        ckpt = _checkpoint_dir(run_dir, s)
        evals[s] = evaluate_policy(str(ckpt), held, _template(spec), k=exp.k,
                                   max_new_tokens=exp.eval_max_new_tokens, seed=seed)  # fmt: skip
    evals[steps] = evaluate_policy(rl["model_dir"], held, _template(spec), k=exp.k,
                                   max_new_tokens=exp.eval_max_new_tokens, seed=seed)  # fmt: skip
    return {
        "seed": seed,
        "arm": arm,
        "steps": steps,
        "evals": {str(s): v for s, v in sorted(evals.items())},
        "train_curves": train_curves(run_dir / "metrics.jsonl"),
        "base_eval_s": base["eval_s"],
        "rl_s": round(rl_s, 1),
        "run_dir": str(run_dir),
    }


def _checkpoint_dir(run_dir: Path, step: int) -> Path:
    from rlhflab.checkpoint.format import committed_checkpoints, step_of

    for ckpt in committed_checkpoints(run_dir):
        if step_of(ckpt) == step:
            return ckpt
    raise ValueError(
        f"r1-zero: no committed checkpoint at step {step} in {run_dir}; "
        "experiment.eval_steps must be multiples of rl.checkpoint.every (keep_last: null)"
    )


def train_curves(metrics_path: Path) -> dict[str, list[float]]:
    """Per-step training-rollout means from a run's metrics.jsonl: "step", "len" (mean
    completion tokens), "correct" (`rollout/reward/exact_match_mean`), "format"
    (`rollout/reward/think_format_mean`, None where not a reward of the arm)."""
    from rlhflab.tracking import read_metrics

    rows = [r for r in read_metrics(metrics_path) if "rollout/response_len_mean" in r]
    return {
        "step": [int(r["step"]) for r in rows],
        "len": [float(r["rollout/response_len_mean"]) for r in rows],
        "correct": [r.get("rollout/reward/exact_match_mean") for r in rows],
        "format": [r.get("rollout/reward/think_format_mean") for r in rows],
    }


# ---------------------------------------------------------------------------------------------
# Estimates and the report


def gains(results: dict[str, dict], arm: str, key: str) -> list[float]:
    """Per-seed final − base of held-out `key` ("pass1", "len", "greedy", ...) for `arm`, in the
    order of the cells (seed-major)."""
    out = []
    for r in results.values():
        if r["arm"] != arm:
            continue
        ev = r["evals"]
        first, last = ev["0"][key], ev[str(r["steps"])][key]
        out.append(last - first)
    return out


def precondition(bases: list[dict]) -> dict:
    """The base's worked − short correctness of samples at T = 1, per seed and its t interval over
    seeds; with the pooled counts and style shares."""
    diffs, rows = [], []
    for b in bases:
        ev = b["eval"]
        acc, n = ev["style_acc"], ev["style_n"]
        row = {"seed": b["seed"], "worked_acc": acc["worked"], "short_acc": acc["short"],
               "worked_n": n["worked"], "short_n": n["short"],
               "worked_frac": ev["style_frac"]["worked"], "pass1": ev["pass1"],
               "len": ev["len"]}  # fmt: skip
        rows.append(row)
        if acc["worked"] is not None and acc["short"] is not None:
            diffs.append(acc["worked"] - acc["short"])
    est = t_interval(diffs) if diffs else (float("nan"), None, None)
    return {"per_seed": rows, "worked_minus_short": est}


def estimates(results: dict[str, dict], arms: list[str]) -> dict:
    """Every check's estimate: `<arm>_correctness_gain` / `<arm>_length_gain` (pass@1 and sample
    length, final − base, t interval over seeds), with the main arm's also under the criterion's
    keys, and `<arm>_greedy_gain`."""
    est = {}
    for arm in arms:
        est[f"{arm}_correctness_gain"] = t_interval(gains(results, arm, "pass1"))
        est[f"{arm}_length_gain"] = t_interval(gains(results, arm, "len"))
        est[f"{arm}_greedy_gain"] = t_interval(gains(results, arm, "greedy"))
    est["correctness_gain"] = est[f"{MAIN_ARM}_correctness_gain"]
    est["length_gain"] = est[f"{MAIN_ARM}_length_gain"]
    return est


def _fmt(x, d=3) -> str:
    return "–" if x is None else f"{x:.{d}f}"


def _ci(v) -> str:
    return format_interval(v)


def plot(results: dict[str, dict], arms: list[str], path: Path) -> None:
    """Correctness and length against step per arm, mean over seeds with a min–max band: training
    rollouts (lines) and held-out pass@1 / sample length at the evaluated steps (markers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), dpi=100)
    for j, arm in enumerate(arms):
        rs = [r for r in results.values() if r["arm"] == arm]
        color = f"C{j}"
        for ax, tkey, hkey in ((axes[0], "correct", "pass1"), (axes[1], "len", "len")):
            curves = [r["train_curves"] for r in rs]
            n = min(len(c["step"]) for c in curves)
            steps = curves[0]["step"][:n]
            vals = [[c[tkey][i] for c in curves] for i in range(n)]
            if all(all(v is not None for v in vs) for vs in vals):
                w = 5  # a 5-step running mean of the per-step training means
                mean = [sum(vs) / len(vs) for vs in vals]
                lo, hi = [min(vs) for vs in vals], [max(vs) for vs in vals]
                sm = [sum(mean[max(0, i - w + 1) : i + 1]) / len(mean[max(0, i - w + 1) : i + 1])
                      for i in range(n)]  # fmt: skip
                ax.plot(steps, sm, color=color, lw=1.2, alpha=0.8,
                        label=f"{arm}: training rollouts (5-step mean)")  # fmt: skip
                ax.fill_between(steps, lo, hi, color=color, alpha=0.08)
            ev_steps = sorted(int(s) for s in rs[0]["evals"])
            ys = [[r["evals"][str(s)][hkey] for r in rs] for s in ev_steps]
            ax.errorbar(ev_steps, [sum(y) / len(y) for y in ys],
                        yerr=[[sum(y) / len(y) - min(y) for y in ys],
                              [max(y) - sum(y) / len(y) for y in ys]],
                        color=color, marker="o", ms=5, lw=2, capsize=3,
                        label=f"{arm}: held-out (mean, min–max over seeds)")  # fmt: skip
    axes[0].set_title("correctness (pass@1 at T = 1)")
    axes[1].set_title("mean response length (tokens)")
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("R1-Zero at CPU scale: correctness and length against step, per arm", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def report(spec: dict, cells_results: dict[str, dict], out: Path, source: str) -> dict:
    """The verdict, the estimates, the precondition, the plot and report.md."""
    exp = _spec(spec, source)
    arms = list(exp.arms)
    bases = [json.loads((out / "bases" / f"seed{s}.json").read_text()) for s in exp.seeds]
    pre = precondition(bases)
    est = estimates(cells_results, arms)
    secondary = SECONDARY if {"dr_grpo", "no_format"} <= set(arms) else None
    verdict = judge("r1-zero", CRITERION, est, exp.seeds, secondary=secondary)
    plot(cells_results, arms, out / "r1_zero.png")
    heldout = _read_jsonl(out / "heldout.jsonl")
    md = _markdown(spec, exp, cells_results, bases, pre, est, verdict, arms, heldout)
    return {
        "verdict": verdict,
        "report": md,
        "estimates": {k: list(v) for k, v in est.items()},
        "precondition": pre,
        "bases": bases,
        "cells": cells_results,
        "plot": "r1_zero.png",
    }


def _example(ops: list[str]) -> list:
    """The report's example chain: 7, 3, 2, 4 joined by the configured operations in turn."""
    return [7, ops[0], 3, ops[1 % len(ops)], 2, ops[2 % len(ops)], 4]


def _what_the_rise_is(results: dict[str, dict]) -> list[str]:
    """A bullet on what the main arm's change is made of: the worked share and the worked style's
    accuracy and length, base → final (means over seeds)."""
    rs = [r for r in results.values() if r["arm"] == MAIN_ARM]
    if not rs:
        return []

    def mean(f):
        xs = [f(r) for r in rs]
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else float("nan")

    def at(r, end):
        return r["evals"][str(r["steps"]) if end else "0"]

    share = [mean(lambda r, e=e: at(r, e)["style_frac"]["worked"]) for e in (False, True)]
    acc = [mean(lambda r, e=e: at(r, e)["style_acc"]["worked"]) for e in (False, True)]
    length = [mean(lambda r, e=e: at(r, e)["style_len"]["worked"]) for e in (False, True)]
    return [
        f"- What the {MAIN_ARM} arm's change is made of (means over seeds, base → final): the "
        f"worked style's share of the samples {share[0]:.2f} → {share[1]:.2f}, its accuracy "
        f"{acc[0]:.2f} → {acc[1]:.2f}, its length {length[0]:.1f} → {length[1]:.1f} tokens. "
        "Where the share moves and the style's own accuracy does not, RL selected the longer, "
        "more accurate style the base already wrote rather than improving either style, and the "
        "mean length can rise only up to the worked style's own. R1-Zero's length keeps growing "
        "over thousands of steps as new reasoning behaviours appear; that is not tested here."
    ]


def _markdown(spec, exp, results, bases, pre, est, verdict, arms, heldout) -> str:
    rl = spec["rl"]
    ro = rl["rollout"]
    d_est, d_lo, d_hi = pre["worked_minus_short"]
    ops = ", ".join(exp.ops)
    ex = _example(exp.ops)
    lines = [
        "# R1-Zero at CPU scale: does RL from a base raise correctness and length together?",
        "",
        f"**Question.** {CRITERION.claim}. Does GRPO from a tiny base, on a task where the longer "
        "(worked) answer style is the more accurate one, raise held-out correctness and mean "
        "response length together?",
        "",
        "**Setting.** Chains of "
        f"{exp.terms[0]}–{exp.terms[1]} numbers in 1..{exp.max_term} joined by {ops}, applied "
        f"left to right modulo 10; {exp.n_train} training "
        f"problems, {exp.n_heldout} held-out questions absent from training. "
        + (
            f"One base model shared by the seeds {exp.seeds} (trained once, seed "
            f"{bases[0]['base_seed']}; each RL seed starts from it and "
            "evaluates it with its own sampling draws), from scratch "
            if exp.shared_base
            else f"Per seed ({exp.seeds}), a base model from scratch "
        )
        + "(`base` stage: a "
        f"{spec['base']['model'].get('build', {}).get('size', '?')} "
        f"{spec['base']['model'].get('build', {}).get('arch', '?')} model, "
        f"{spec['base']['train']['steps']} steps of plain-text documents, every token trained) "
        "whose documents answer "
        f"{1 - exp.worked_frac:.0%} of problems short (`{completion(ex, worked=False)}`) "
        f"and {exp.worked_frac:.0%} worked (`{completion(ex, worked=True)}` for "
        f"{''.join(map(str, ex))}); both satisfy R1's format reward. "
        + (
            f"**Designed precondition:** a short document's answer is a wrong guess (the right "
            f"one ± 1..3 modulo 10) with probability {exp.short_error} (`experiment.short_error`), "
            "a worked document's answer is always right — answers given in the head are less "
            "reliable than worked ones, by construction of the base's data (as in the text real "
            "base models read). "
            if exp.short_error > 0
            else ""
        )
        + "RL from that base: "
        f"{rl['train']['steps']} steps of {ro['prompts_per_step']} prompts × {ro['group_size']} "
        f"samples, {ro['max_new_tokens']} new tokens, lr {rl['optim']['lr']}, arms "
        f"{', '.join(f'`{a}`' for a in arms)} (`grpo`: exact-match correctness + think_format, "
        "group z-score, per-sequence token mean; `dr_grpo`: group-mean advantage and "
        "`seq_mean_token_sum_norm`; `no_format`: correctness reward alone). Held-out: pass@1 over "
        f"{exp.k} samples at T = 1 and greedy correctness; length = completion tokens of the "
        "samples (EOS counted).",
        "",
        "## Precondition: the worked style is the more accurate one on the base",
        "",
        "| seed | worked: correct / samples | short: correct / samples | worked share | "
        "base pass@1 | base length |",
        "|---|---|---|---|---|---|",
    ]
    for r in pre["per_seed"]:
        wa = r["worked_acc"] or 0.0
        sa = r["short_acc"] or 0.0
        lines.append(
            f"| {r['seed']} | {_fmt(r['worked_acc'])} ({round(wa * r['worked_n'])}/"
            f"{r['worked_n']}) | {_fmt(r['short_acc'])} ({round(sa * r['short_n'])}/"
            f"{r['short_n']}) | {r['worked_frac']:.3f} | {_fmt(r['pass1'])} | {_fmt(r['len'], 1)} |"
        )
    ci = f"[{d_lo:+.3f}, {d_hi:+.3f}]" if d_lo is not None else "(no CI)"
    holds = d_lo is not None and d_lo > 0
    docs = {b["base"]: b["documents"] for b in bases}
    base_train = {b["base"]: b["train_s"] for b in bases}
    lines += [
        "",
        "Base documents (as constructed): "
        + "; ".join(
            f"{k}: {d['worked']} worked, {d.get('short', d['documents'] - d['worked'])} "
            f"short of which {d.get('short_wrong', 0)} with a wrong answer"
            for k, d in docs.items()
        )
        + ". Base training: "
        + ", ".join(f"{k} {t:.0f} s" for k, t in base_train.items())
        + ".",
        "",
        f"Worked − short correctness of the base's samples: **{d_est:+.3f}** {ci} (95% t interval "
        "over seeds"
        + (
            "; one shared base, so it covers the seeds' sampling draws, not base training"
            if exp.shared_base
            else ""
        )
        + f"): the precondition {'holds' if holds else 'does not hold'}.",
        "",
        "## Verdict (pre-registered)",
        "",
        verdict_table(verdict),
        "",
        "![correctness and length against step per arm](r1_zero.png)",
        "",
        "## Every arm: final − base, paired over seeds (95% t interval)",
        "",
        "| arm | pass@1 gain | greedy gain | length gain (tokens) |",
        "|---|---|---|---|",
    ]
    for arm in arms:
        lines.append(f"| {arm} | {_ci(est[f'{arm}_correctness_gain'])} | "
                     f"{_ci(est[f'{arm}_greedy_gain'])} | {_ci(est[f'{arm}_length_gain'])} |")  # fmt: skip
    lines += [
        "",
        "## Held-out numbers per cell (base → final)",
        "",
        "| cell | pass@1 | greedy | length | length, correct | length, incorrect | worked share "
        "| worked acc | short acc | format |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell, r in results.items():
        a, b = r["evals"]["0"], r["evals"][str(r["steps"])]

        def pair(key, d=3, a=a, b=b):
            return f"{_fmt(a[key], d)} → {_fmt(b[key], d)}"

        def spair(group, s, a=a, b=b):
            return f"{_fmt(a[group][s])} → {_fmt(b[group][s])}"

        lines.append(
            f"| {cell} | {pair('pass1')} | {pair('greedy')} | {pair('len', 1)} | "
            f"{pair('len_correct', 1)} | {pair('len_incorrect', 1)} | "
            f"{spair('style_frac', 'worked')} | {spair('style_acc', 'worked')} | "
            f"{spair('style_acc', 'short')} | {pair('format')} |"
        )
    half = {k: (v[2] - v[0]) for k, v in est.items() if v[1] is not None}
    lines += [
        "",
        f"Power: with {len(exp.seeds)} seeds the 95% interval's half-width was "
        f"{half.get('correctness_gain', float('nan')):.3f} for the pass@1 gain and "
        f"{half.get('length_gain', float('nan')):.1f} tokens for the length gain (GRPO arm): a mean "
        "gain smaller than that could not be told from 0 with this seed-to-seed spread.",
        "",
        f"Held-out composition: {sum(len(p['terms']) == 2 * exp.terms[0] - 1 for p in heldout)} of "
        f"{len(heldout)} problems have {exp.terms[0]} numbers (most short chains are in the "
        "training set, and held-out questions are absent from it).",
    ]
    lines += ["", "## What did not reproduce", ""]
    failed = [c for c in verdict["checks"] if not c["holds"]]
    sec = verdict.get("secondary")
    failed_sec = [c for c in sec["checks"] if not c["holds"]] if sec else []
    if not holds:
        lines.append(
            f"- The precondition: the base's worked style was not clearly the more accurate "
            f"({d_est:+.3f} {ci}), so RL had no accuracy to gain by writing longer; the criterion "
            "then tests the design as much as the paper's claim. The base's pass@1 was "
            + ", ".join(_fmt(r["pass1"]) for r in pre["per_seed"])
            + " (seeds in order; a uniform guess of a one-digit answer scores 0.100): where the "
            "base has not learned the worked steps, a designed error rate in the short answers "
            "cannot make the worked ones the more accurate."
        )
    if not failed and not failed_sec:
        lines.append("Every pre-registered check, primary and secondary, held.")
    lines += _what_the_rise_is(results)
    for c in failed + failed_sec:
        ci95 = "(no CI)" if c["ci95"] is None else f"[{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]"
        lines.append(f"- {c['what']}: {c['estimate']:+.3f} {ci95}, rule: {c['rule']}.")
    lines += [
        '- Not attempted at this scale: reflection or "aha" behaviour (the base has never seen '
        "any), the paper's long-horizon growth of length (tens of RL steps here, thousands there), "
        "a real base model reading an instruction (the styles exist in the base's documents).",
        "",
        "Numbers: `r1_zero.json`; cells: `cells/*.json`; config as `spec.json`.",
    ]
    return "\n".join(lines) + "\n"

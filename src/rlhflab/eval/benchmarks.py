"""Named benchmark protocols: GSM8K, MATH-500, AIME 2024 / 2025 and IFEval, each read from its
published file format on local disk and run with the prompt, decoding, sample count, token
budget, answer extraction and metric of a named reference (docs/benchmarks.md).

    rlhflab eval MODEL --benchmark NAME [--benchmark-file PATH]

The file: `--benchmark-file`, else `$RLHFLAB_BENCHMARKS_DIR/<default file name>` (default
folder `~/.cache/rlhflab/benchmarks`); nothing is downloaded. A missing or malformed file is a
one-line DataError naming the file (and row and field) and the expected schema.

Metrics, per problem from its n samples, then the mean over problems with its standard error
over problems (sample std / sqrt(#problems), `accuracy.mean_and_stderr`):
* avg@n: the mean correctness of the n samples (DeepSeek-R1's "pass@1" with k samples; with
  one greedy sample it is the accuracy);
* pass@k: the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374, eq. 1);
* maj@k: majority vote over blocks of k samples (Wang et al. 2022, arXiv 2203.11171; DeepSeek-R1's
  cons@64); answers vote together when math-verify finds them equivalent
  (`rlhflab.eval.passk.maj_at_k`).
Math answers: the completion's answer is its last `\\boxed{}` (`extract_math_answer`), else what
math-verify extracts from the whole text (an expression or the last number); it is compared with
the gold by `math_verify.verify` (the gold wrapped in `\\boxed{}`: GSM8K's number after "####"
with thousands separators removed, MATH's and AIME's `answer`). IFEval: prompt- and instruction-level accuracy, strict and loose
(`rlhflab.eval.ifeval`, a documented subset of the checkers).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhflab.errors import DataError

#: Environment variable naming the folder of benchmark files (default `DEFAULT_DIR`).
ENV_DIR = "RLHFLAB_BENCHMARKS_DIR"
DEFAULT_DIR = "~/.cache/rlhflab/benchmarks"
#: The system turn of Qwen2.5-Math's "qwen25-math-cot" prompt (evaluation/utils.py).
QWEN_MATH_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
#: DeepSeek-R1's recommended directive for maths (README, "Usage Recommendations"): in the user
#: turn, no system prompt.
R1_MATH_DIRECTIVE = "Please reason step by step, and put your final answer within \\boxed{}."

_QWEN_MATH_SOURCE = (
    "Qwen2.5-Math evaluation (github.com/QwenLM/Qwen2.5-Math, evaluation/sh/eval.sh: "
    "--prompt_type qwen25-math-cot --temperature 0 --n_sampling 1 --top_p 1; math_eval.py: "
    "--max_tokens_per_call 2048); Yang et al. 2024, arXiv 2409.12122"
)
_R1_SOURCE = (
    "DeepSeek-R1 (arXiv 2501.12948, evaluation setup; README): maximum generation length "
    "32,768 tokens, temperature 0.6, top-p 0.95, 64 responses per query to estimate pass@1; "
    "cons@64 is majority voting over the 64"
)


@dataclass(frozen=True)
class Protocol:
    """One benchmark's file format and evaluation protocol.

    Attributes:
        name: the `--benchmark` name.
        kind: "math" (math-verify correctness) or "ifeval" (instruction checkers).
        fields: the row fields read (each row must have them; `aliases` may stand in).
        file_name: the default file name under `$RLHFLAB_BENCHMARKS_DIR`.
        file_source: where the published file comes from (dataset id and file).
        question_field, answer_field: the fields holding the question and the gold answer.
        system, template: the system turn (None: none) and the user turn, `{question}` replaced
            by the question (plain replacement: the template's other braces are literal).
        greedy: argmax decoding (then `n_samples` is 1); else `temperature` and `top_p`.
        n_samples: samples per problem (the n of avg@n).
        ks: the k of pass@k and maj@k reported (each <= n_samples).
        max_new_tokens: the generation budget per completion (tokens).
        headline: the metric key reported first.
        source: the reference the protocol follows (cited in the results).
        aliases: {field: alternative field name accepted in its place}.
    """

    name: str
    kind: str
    fields: tuple[str, ...]
    file_name: str
    file_source: str
    question_field: str
    answer_field: str | None
    system: str | None
    template: str
    greedy: bool
    temperature: float
    top_p: float
    n_samples: int
    ks: tuple[int, ...]
    max_new_tokens: int
    headline: str
    source: str
    aliases: dict = field(default_factory=dict, hash=False)

    def schema(self) -> str:
        """The expected row schema in one phrase, for error messages."""
        alt = "".join(f" (or {a} for {f})" for f, a in self.aliases.items())
        return f"one JSON object per line with fields {', '.join(self.fields)}{alt}"


def _aime(name: str, year: str, files: str) -> Protocol:
    return Protocol(
        name=name, kind="math", fields=("problem", "answer"), file_name=f"{name}.jsonl",
        file_source=files, question_field="problem", answer_field="answer", system=None,
        template="{question}\n" + R1_MATH_DIRECTIVE, greedy=False, temperature=0.6, top_p=0.95,
        n_samples=64, ks=(1, 64), max_new_tokens=32768, headline="avg@64",
        source=_R1_SOURCE + f" (AIME {year})", aliases={"problem": "question"},
    )  # fmt: skip


BENCHMARKS: dict[str, Protocol] = {
    "gsm8k": Protocol(
        name="gsm8k", kind="math", fields=("question", "answer"), file_name="gsm8k_test.jsonl",
        file_source="openai/grade-school-math grade_school_math/data/test.jsonl (1319 rows; the "
        "Hub's openai/gsm8k main test split has the same fields)",
        question_field="question", answer_field="answer", system=QWEN_MATH_SYSTEM,
        template="{question}", greedy=True, temperature=1.0, top_p=1.0, n_samples=1, ks=(),
        max_new_tokens=2048, headline="accuracy", source=_QWEN_MATH_SOURCE,
    ),
    "math500": Protocol(
        name="math500", kind="math",
        fields=("problem", "solution", "answer", "subject", "level", "unique_id"),
        file_name="math500_test.jsonl",
        file_source="HuggingFaceH4/MATH-500 test.jsonl (500 rows; Lightman et al. 2023's split)",
        question_field="problem", answer_field="answer", system=QWEN_MATH_SYSTEM,
        template="{question}", greedy=True, temperature=1.0, top_p=1.0, n_samples=1, ks=(),
        max_new_tokens=2048, headline="accuracy", source=_QWEN_MATH_SOURCE,
    ),
    "aime24": _aime("aime24", "2024", "HuggingFaceH4/aime_2024 (30 rows: id, problem, solution, "
                    "answer, url, year; or the 2024 rows of AI-MO/aimo-validation-aime)"),
    "aime25": _aime("aime25", "2025", "a 30-row AIME 2025 I+II file with problem and answer "
                    "(e.g. yentinglin/aime_2025; opencompass/AIME2025 names the problem "
                    "'question')"),
    "ifeval": Protocol(
        name="ifeval", kind="ifeval", fields=("key", "prompt", "instruction_id_list", "kwargs"),
        file_name="ifeval_input_data.jsonl",
        file_source="google/IFEval input_data.jsonl (541 rows; google-research/google-research "
        "instruction_following_eval/data/input_data.jsonl)",
        question_field="prompt", answer_field=None, system=None, template="{question}",
        greedy=True, temperature=1.0, top_p=1.0, n_samples=1, ks=(), max_new_tokens=1280,
        headline="prompt_level_strict_acc",
        source="IFEval (Zhou et al. 2023, arXiv 2311.07911; google-research "
        "instruction_following_eval/evaluation_lib.py) as run by lm-evaluation-harness's ifeval "
        "task: the prompt as the only user turn, greedy (do_sample false, temperature 0), "
        "max_gen_toks 1280, prompt/instruction-level strict and loose accuracy",
    ),
}  # fmt: skip


@dataclass
class BenchmarkItem:
    """One benchmark row: `question` (the text put in the prompt template), `gold` (the gold
    answer as math-verify reads it, None for IFEval), `row` (the file's row) and `index` (its
    0-based line among the file's rows)."""

    question: str
    gold: str | None
    row: dict
    index: int


def benchmark_path(name: str, given: str | None = None) -> Path:
    """The file of benchmark `name`: `given`, else `$RLHFLAB_BENCHMARKS_DIR/<file_name>` (default
    folder `~/.cache/rlhflab/benchmarks`). Raises DataError for an unknown name."""
    proto = get_protocol(name)
    if given:
        return Path(given).expanduser()
    return Path(os.environ.get(ENV_DIR) or DEFAULT_DIR).expanduser() / proto.file_name


def get_protocol(name: str) -> Protocol:
    """The protocol named `name`. Raises DataError naming the known benchmarks."""
    if name not in BENCHMARKS:
        raise DataError(f"--benchmark {name!r}: unknown; known: {', '.join(BENCHMARKS)}")
    return BENCHMARKS[name]


def gold_text(proto: Protocol, value: Any, where: str) -> str:
    """The gold answer of a row as math-verify should read it: GSM8K's number after the last
    "####" (thousands separators removed), MATH's / AIME's `answer`, each wrapped in
    `\\boxed{}`. Raises DataError (naming `where`) when GSM8K's answer has no "####"."""
    text = str(value).strip()
    if proto.name == "gsm8k":
        if "####" not in text:
            raise DataError(f"{where}: field 'answer' has no '#### <number>' final line (GSM8K)")
        text = text.rpartition("####")[2].strip().replace(",", "")
    return "\\boxed{" + text + "}"


def load_benchmark(name: str, path: str | Path | None = None) -> list[BenchmarkItem]:
    """The rows of benchmark `name` from its local file (a .jsonl file: one JSON object a line;
    a .json file holding a list of them is read too).

    Raises:
        DataError: one line naming the file and, for a bad row, its line number and field, with
            the expected schema and where the file comes from: no such file, not JSON, a row
            that is not an object, a missing field, a field of the wrong type, an empty file.
    """
    proto = get_protocol(name)
    p = benchmark_path(name, None if path is None else str(path))
    hint = f"expected {proto.schema()}: {proto.file_source}"
    if not p.is_file():
        raise DataError(
            f"--benchmark {name}: no file {p} (put the file there, pass --benchmark-file PATH, or "
            f"set {ENV_DIR}); {hint}"
        )
    text = p.read_text(encoding="utf-8")
    rows: list[tuple[int, Any]] = []
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{p}: not valid JSON ({exc.msg}); {hint}") from None
        rows = list(enumerate(data, 1)) if isinstance(data, list) else [(1, data)]
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append((lineno, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DataError(f"{p} line {lineno}: not valid JSON ({exc.msg}); {hint}") from None
    if not rows:
        raise DataError(f"{p}: no rows; {hint}")
    return [_item(proto, row, f"{p} line {lineno}", hint, i) for i, (lineno, row) in
            enumerate(rows)]  # fmt: skip


def _item(proto: Protocol, row: Any, where: str, hint: str, index: int) -> BenchmarkItem:
    """One validated row (see `load_benchmark`)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}; {hint}")
    for f in proto.fields:
        if f not in row and proto.aliases.get(f) not in row:
            raise DataError(
                f"{where}: missing field {f!r} (has {', '.join(row) or 'none'}); {hint}"
            )
    q_field = proto.question_field
    q_field = q_field if q_field in row else proto.aliases[q_field]
    question = row[q_field]
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: field {q_field!r} must be a non-empty string; {hint}")
    if proto.kind == "ifeval":
        ids, kwargs = row["instruction_id_list"], row["kwargs"]
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise DataError(f"{where}: field 'instruction_id_list' must be a list of strings")
        if not isinstance(kwargs, list) or len(kwargs) != len(ids):
            raise DataError(
                f"{where}: field 'kwargs' must be a list of {len(ids)} objects, one per "
                "instruction id"
            )
        if not all(k is None or isinstance(k, dict) for k in kwargs):
            raise DataError(f"{where}: field 'kwargs' must hold JSON objects")
        return BenchmarkItem(question=question, gold=None, row=row, index=index)
    answer = row[proto.answer_field]
    if (
        isinstance(answer, bool)
        or not isinstance(answer, str | int | float)
        or not str(answer).strip()
    ):
        raise DataError(
            f"{where}: field {proto.answer_field!r} must be a non-empty string or number; {hint}"
        )  # fmt: skip
    return BenchmarkItem(question=question, gold=gold_text(proto, answer, where), row=row,
                         index=index)  # fmt: skip


# ----------------------------------------------------------------------------- scoring


def _mv_parse(text: str) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])


def extract_math_answer(text: str) -> list:
    """math-verify's parse of a completion's final answer: the content of its LAST
    `\\boxed{...}` (braces matched) when it has one — math-verify alone would read
    "\\boxed{17} ... \\boxed{204}" as the set {17, 204}, Qwen2.5-Math's `extract_answer` takes
    the last box — else math-verify's own extraction from the whole text (a LaTeX expression or
    the last number). Returns [] when nothing is found."""
    from rlhflab.rewards.verifier import extract_answer

    boxed = extract_answer(text, answer_format="boxed")
    return _mv_parse("\\boxed{" + boxed + "}" if boxed is not None else text)


def math_scores(gold: str, completions: list[str]) -> tuple[list[float], list[int | None]]:
    """Correctness and vote of each completion of one math problem.

    Args:
        gold: the gold answer (`gold_text`, e.g. "\\boxed{18}").
        completions: the problem's n completion texts.
    Returns:
        (scores: 1.0 where math-verify finds the completion's answer equivalent to the gold,
        else 0.0; votes: the cluster id of each extracted answer — answers math-verify finds
        equivalent share one id — None where nothing was extracted).
    Source: math-verify (github.com/huggingface/Math-Verify): `parse`, then `verify(gold, answer)`.
    """
    from math_verify import verify

    parsed_gold = _mv_parse(gold)
    scores, votes, reps = [], [], []
    for text in completions:
        answer = extract_math_answer(text)
        if not answer:
            scores.append(0.0)
            votes.append(None)
            continue
        scores.append(1.0 if parsed_gold and verify(parsed_gold, answer) else 0.0)
        for cid, rep in enumerate(reps):
            if verify(rep, answer):
                votes.append(cid)
                break
        else:
            reps.append(answer)
            votes.append(len(reps) - 1)
    return scores, votes


def score_benchmark(proto: Protocol, items: list[BenchmarkItem], completions: list[list[str]],
                    *, ks: tuple[int, ...] | list[int] | None = None) -> dict:  # fmt: skip
    """The protocol's metrics from known completions (no model): the scoring path of
    `run_benchmark`.

    Args:
        items: the benchmark rows (`load_benchmark`).
        completions: per item its n completion texts (n the same for every item).
        ks: the k of pass@k / maj@k (default the protocol's, those <= n).
    Returns:
        Math: {"n" (problems), "n_samples", "avg@<n>" and "accuracy" (the same mean
        correctness), "pass@<k>", "maj@<k>" (each k in ks), each with "<key>_stderr" (over
        problems), "per_problem" ({key: per-problem list})}. IFEval: {"n" (prompts scored),
        "n_samples" (1), "prompt_level_strict_acc", "inst_level_strict_acc",
        "prompt_level_loose_acc", "inst_level_loose_acc" (each with "_stderr"; instruction-level
        stderr over instructions), "n_instructions", "n_skipped" (prompts with an unsupported
        instruction, left out), "unsupported_ids" (sorted), "comparable" (False when any prompt
        was left out)}.
    Raises:
        ValueError: completions and items differ in length, or items have different n.
    """
    from rlhflab.eval.accuracy import mean_and_stderr
    from rlhflab.eval.passk import maj_at_k, pass_at_k

    if len(completions) != len(items):
        raise ValueError(f"{len(completions)} completion lists for {len(items)} items")
    ns = {len(c) for c in completions}
    if len(ns) != 1 or 0 in ns:
        raise ValueError(f"every item needs the same n >= 1 completions (got {sorted(ns)})")
    n = ns.pop()
    if proto.kind == "ifeval":
        return _score_ifeval(items, completions)
    ks = sorted({k for k in (proto.ks if ks is None else ks) if k <= n})
    per: dict[str, list[float]] = {f"avg@{n}": []}
    for k in ks:
        per[f"pass@{k}"], per[f"maj@{k}"] = [], []
    for item, texts in zip(items, completions, strict=True):
        scores, votes = math_scores(item.gold, texts)
        per[f"avg@{n}"].append(sum(scores) / n)
        for k in ks:
            per[f"pass@{k}"].append(pass_at_k(n, int(sum(scores)), k))
            per[f"maj@{k}"].append(maj_at_k(votes, scores, k))
    out: dict = {"n": len(items), "n_samples": n}
    for key, values in per.items():
        out[key], out[f"{key}_stderr"] = mean_and_stderr(values)
    out["accuracy"], out["accuracy_stderr"] = out[f"avg@{n}"], out[f"avg@{n}_stderr"]
    out["per_problem"] = per
    return out


def _score_ifeval(items: list[BenchmarkItem], completions: list[list[str]]) -> dict:
    """IFEval's four accuracies over the prompts whose every instruction is supported."""
    from rlhflab.eval.accuracy import mean_and_stderr
    from rlhflab.eval.ifeval import CHECKERS, follows

    per: dict[str, list[float]] = {"prompt_level_strict_acc": [], "prompt_level_loose_acc": []}
    inst: dict[str, list[float]] = {"inst_level_strict_acc": [], "inst_level_loose_acc": []}
    unsupported: set[str] = set()
    skipped = 0
    for item, texts in zip(items, completions, strict=True):
        ids, kwargs = item.row["instruction_id_list"], item.row["kwargs"]
        missing = [i for i in ids if i not in CHECKERS]
        if missing:
            unsupported.update(missing)
            skipped += 1
            continue
        for mode, loose in (("strict", False), ("loose", True)):
            followed = [f for t in texts for f in follows(t, ids, kwargs, loose=loose)]
            per[f"prompt_level_{mode}_acc"].append(float(all(followed)))
            inst[f"inst_level_{mode}_acc"].extend(float(f) for f in followed)
    out: dict = {"n": len(per["prompt_level_strict_acc"]), "n_samples": 1}
    for key, values in {**per, **inst}.items():
        out[key], out[f"{key}_stderr"] = mean_and_stderr(values)
    out["n_instructions"] = len(inst["inst_level_strict_acc"])
    out["n_skipped"] = skipped
    out["unsupported_ids"] = sorted(unsupported)
    out["comparable"] = skipped == 0
    out["per_problem"] = per
    return out


# ----------------------------------------------------------------------------- running


def protocol_settings(proto: Protocol, *, n_samples: int | None = None,
                      max_new_tokens: int | None = None, ks: list[int] | None = None,
                      limit: int | None = None) -> tuple[dict, list[str]]:  # fmt: skip
    """The settings a run uses and the departures from the protocol, one line each.

    Returns:
        ({"greedy", "temperature", "top_p", "n_samples", "max_new_tokens", "ks"}, departures):
        each given value that differs from the protocol's is named in `departures` ("n_samples
        8 (protocol: 64)"), as is a `limit` on the rows; an empty list means the run follows
        the protocol.
    Raises:
        DataError: n_samples > 1 for a greedy protocol, or a k above n_samples.
    """
    s = {"greedy": proto.greedy, "temperature": proto.temperature, "top_p": proto.top_p,
         "n_samples": proto.n_samples, "max_new_tokens": proto.max_new_tokens,
         "ks": list(proto.ks)}  # fmt: skip
    departures = []
    for key, value in (("n_samples", n_samples), ("max_new_tokens", max_new_tokens)):
        if value is not None and value != s[key]:
            departures.append(f"{key} {value} (protocol: {s[key]})")
            s[key] = value
    if ks is not None and sorted(ks) != s["ks"]:
        departures.append(f"k {','.join(map(str, ks))} (protocol: {','.join(map(str, s['ks']))})")
        s["ks"] = sorted(ks)
    if proto.greedy and s["n_samples"] != 1:
        raise DataError(
            f"--benchmark {proto.name}: the protocol is greedy (one completion per problem); "
            "--n-samples applies to sampled protocols (aime24, aime25)"
        )
    if s["ks"] and max(s["ks"]) > s["n_samples"]:
        raise DataError(
            f"--benchmark {proto.name}: k {max(s['ks'])} exceeds the {s['n_samples']} samples per "
            "problem (lower --k or raise --n-samples)"
        )
    if limit is not None:
        departures.append(f"first {limit} rows only (protocol: every row)")
    return s, departures


def generate(model, tokenizer, proto: Protocol, items: list[BenchmarkItem], settings: dict, *,
             batch_size: int = 64, seed: int = 0, engine=None) -> list[list[str]]:  # fmt: skip
    """The protocol's completions of every item: its prompt (system turn and user template
    through the model's chat template), `settings` (`protocol_settings`) decoding.

    Returns:
        Per item its `settings["n_samples"]` completion texts (special tokens removed).
    Raises:
        DataError: a prompt plus max_new_tokens exceeds the model's context.
    """
    import torch

    from rlhflab.data.formatting import encode_prompt
    from rlhflab.data.prompts import PromptRow, render_row
    from rlhflab.eval.accuracy import _check_context
    from rlhflab.rollout.engines import SamplingParams, make_engine, sample_chunks

    rows = [PromptRow(prompt=proto.template.replace("{question}", it.question), index=it.index)
            for it in items]  # fmt: skip
    prompts = [
        encode_prompt(tokenizer, render_row(tokenizer, r, system=proto.system)) for r in rows
    ]
    _check_context(model, prompts, settings["max_new_tokens"])
    engine = engine or make_engine(None, model, tokenizer)
    n = settings["n_samples"]
    if settings["greedy"]:
        params = SamplingParams(max_new_tokens=settings["max_new_tokens"], greedy=True)
    else:
        params = SamplingParams(n=n, max_new_tokens=settings["max_new_tokens"],
                                temperature=settings["temperature"], top_p=settings["top_p"])  # fmt: skip
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    per_chunk = max(1, batch_size // n)
    out: list[list[str]] = []
    for _, _, texts in sample_chunks(model, engine, tokenizer, prompts, params, chunk=per_chunk,
                                     generator=gen, desc=f"{proto.name} ({len(items)} x {n})"):  # fmt: skip
        out.extend(texts[i : i + n] for i in range(0, len(texts), n))
    return out


def run_benchmark(model_path: str, name: str, *, path: str | None = None,
                  n_samples: int | None = None, max_new_tokens: int | None = None,
                  ks: list[int] | None = None, limit: int | None = None, batch_size: int = 64,
                  seed: int = 0, engine: str = "hf", items: list | None = None) -> dict:  # fmt: skip
    """Benchmark `name` on the model at `model_path` (a Hub id or a saved directory).

    Args:
        path: the benchmark file (default `benchmark_path`).
        n_samples, max_new_tokens, ks: departures from the protocol (None: the protocol's);
            each is named in "departures".
        limit: score only the first `limit` rows (a departure).
        items: already loaded rows (skip reading the file).
    Returns:
        `score_benchmark`'s keys (without "per_problem") plus "benchmark", "model", "file",
        "protocol" ({"source", "system", "template", decoding settings}), "departures" (list of
        lines; empty: the published protocol), "headline_name", "headline", "headline_stderr".
    Raises:
        DataError: the file is missing or malformed; a prompt does not fit the model's context.
        ConfigError: the engine cannot run here.
    """
    import torch

    from rlhflab.config import RolloutConfig
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.rollout.engines import make_engine

    proto = get_protocol(name)
    file = str(benchmark_path(name, path))
    items = load_benchmark(name, file) if items is None else items
    s, departures = protocol_settings(proto, n_samples=n_samples, max_new_tokens=max_new_tokens,
                                      ks=ks, limit=limit)  # fmt: skip
    items = items[:limit] if limit else items
    tokenizer = load_tokenizer(model_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(model_path, device=device)
    sampler = make_engine(RolloutConfig(engine=engine), model, tokenizer)
    texts = generate(model, tokenizer, proto, items, s, batch_size=batch_size, seed=seed,
                     engine=sampler)  # fmt: skip
    res = score_benchmark(proto, items, texts, ks=s["ks"])
    res.pop("per_problem")
    head = proto.headline if proto.kind == "ifeval" else f"avg@{s['n_samples']}"
    return {
        "benchmark": name, "model": model_path, "file": file, **res,
        "headline_name": head, "headline": res[head], "headline_stderr": res[f"{head}_stderr"],
        "protocol": {"source": proto.source, "system": proto.system, "template": proto.template,
                     **s},
        "departures": departures,
    }  # fmt: skip


def benchmark_lines(res: dict) -> list[str]:
    """The results table of one benchmark run: a header (benchmark, n, decoding, source), one
    row per metric "metric  value ± stderr", and the departures from the protocol."""
    p = res["protocol"]
    decoding = ("greedy" if p["greedy"] else
                f"temperature {p['temperature']:g}, top-p {p['top_p']:g}")  # fmt: skip
    lines = [
        f"{res['benchmark']}: n={res['n']} problems x {res['n_samples']} samples, {decoding}, "
        f"max_new_tokens {p['max_new_tokens']} ({res['model']})",
        f"{'metric':<26}{'value':>8}  {'stderr':>7}",
    ]
    keys = [k for k in res if isinstance(res.get(f"{k}_stderr"), float) and k != "headline"
            and k != "accuracy"]  # fmt: skip
    for k in keys:
        se = res[f"{k}_stderr"]
        se_text = f"{se:7.3f}" if se == se else "    n/a"
        lines.append(f"{k:<26}{res[k]:8.3f}  {se_text}")
    if res.get("n_skipped"):
        lines.append(
            f"note: {res['n_skipped']} prompts left out (unsupported instructions: "
            f"{', '.join(res['unsupported_ids'])}); not comparable with published IFEval numbers"
        )
    for d in res.get("departures") or []:
        lines.append(f"departure from the protocol: {d}")
    lines.append(f"protocol: {p['source']}")
    return lines

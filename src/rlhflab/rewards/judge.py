"""An LLM judge as a reward source: a local causal LM prompted with a template, decoded greedily
through a rollout engine (`hf`, or `vllm` where vLLM is installed: `engine`), its output parsed
by a stated rule.

    judge = JudgeScorer.from_pretrained("runs/sft-.../model")        # or any causal-LM path
    judge.score(prompts, completions)                                 # pointwise: [7.0, None, ...]
    judge.score_rubric(prompts, completions, criteria)                # {criterion: [...]}
    judge.choose(prompts, completions_a, completions_b)               # pairwise: ["A", None, ...]

In `rlhflab best-of-n POLICY --judge PATH` a judge picks the best of N by its pointwise score
(`selection_scores`: a parse failure ranks last).

Modes:
    pointwise  one integer score in [low, high] per completion ("Score: 7")
    rubric     one pointwise score per named criterion; the row's score is the weighted mean
               Σ_c w_c s_c / Σ_c w_c of the criteria's scores
    pairwise   "A" or "B": which of two completions of one prompt is better (evaluation and
               agreement only — `rlhflab.eval.agreement.position_bias_rate` — not a reward)

Parse rule (`parse_score`, `parse_choice`), applied to the judge's completion only (never to its
prompt): find every occurrence of `marker` (case-insensitive, default "Score:" / "Choice:");
after each, skip whitespace and markdown emphasis (`* _ ` #`); the value must come first: an
integer (optionally followed by "/<high>", as in "7/10") or the letter A/B. The rest of that
line must hold no other digit (pairwise: no other standalone A/B). Every occurrence must give
the same value. Anything else is a parse failure (None): no marker, a refusal ("Score: I
cannot rate this"), two conflicting numbers ("Score: 7 or 8", "Score: 7.5", "Score: 3 ...
Score: 9"), a number outside [low, high]. A failure is never read as 0.

An answer cut by the judge's budget (`max_new_tokens`: no end-of-sequence token) right after the
score's digits is a parse failure too when one more digit could still be a score in [low, high]
(`cut_score`): "Score: 10" cut to "Score: 1" by a budget one token short would read as a 1.

How a failure enters the reward (`on_parse_failure`):
    "error"  raise RewardError naming the judge, the count and one offending output (default)
    "nan"    the row's value is NaN, left out of the logged means; allowed only with weight 0
             (a NaN may not reach the loss: `score_components` refuses it)
    "min"    the failed score gets `low`, the worst (a judge that cannot say is read as "bad");
             in a rubric only the failed criterion does, the others keep their scores
Either way the failures are counted: the component logs `judge/parse_failed` (1 per failed row,
so `rollout/reward/judge/parse_failed_mean` is the parse-failure rate), and the scorer keeps
running totals (`n_parsed`, `n_failed`).

Caching: the judge's raw output for one request is kept under sha256(judge id, template, the
template's fields: prompt, completion, criterion ...), so an identical request (same judge, same
template, same texts) does not run the model again (`n_generated` counts what did run). The
judge id is its resolved path, dtype, generation budget and engine. The cache is per process, bounded
(`cache_size` entries, least recently used dropped).

As a reward component ("judge" in `rlhflab.rewards.shaping.REWARD_COMPONENTS`):

    reward:
      components:
        - {name: judge, weight: 1.0, args: {path: runs/sft-.../model, low: 1, high: 10}}
        - {name: judge, label: rubric, args: {path: ..., mode: rubric, criteria:
              [{name: correct, weight: 2}, {name: clear, description: "easy to follow"}]}}

Per-criterion scores are logged as `rollout/reward/<label>/<criterion>_mean`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict

import torch
from torch import Tensor

from rlhflab.errors import ConfigError, RewardError

__all__ = [
    "DEFAULT_TEMPLATES",
    "JUDGE_MODES",
    "PARSE_FAILURE_POLICIES",
    "JudgeScorer",
    "cut_score",
    "judge_component",
    "parse_choice",
    "parse_score",
]

JUDGE_MODES = ("pointwise", "rubric", "pairwise")
PARSE_FAILURE_POLICIES = ("error", "nan", "min")

#: The default prompt of each mode; `{field}`s are filled with str.format.
DEFAULT_TEMPLATES = {
    "pointwise": (
        "Rate the response to the question on a scale from {low} to {high}.\n\n"
        "Question: {prompt}\n\nResponse: {completion}\n\n"
        "Answer with one line 'Score: N', N an integer from {low} to {high}."
    ),
    "rubric": (
        "Rate the response to the question for one criterion, {criterion}: {description}, "
        "on a scale from {low} to {high}.\n\n"
        "Question: {prompt}\n\nResponse: {completion}\n\n"
        "Answer with one line 'Score: N', N an integer from {low} to {high}."
    ),
    "pairwise": (
        "Which response answers the question better?\n\n"
        "Question: {prompt}\n\nResponse A: {completion_a}\n\nResponse B: {completion_b}\n\n"
        "Answer with one line 'Choice: A' or 'Choice: B'."
    ),
}
#: The fields each mode's template may use (a template naming another is a ConfigError).
TEMPLATE_FIELDS = {
    "pointwise": {"prompt", "completion", "low", "high"},
    "rubric": {"prompt", "completion", "low", "high", "criterion", "description"},
    "pairwise": {"prompt", "completion_a", "completion_b"},
}
#: The fields a mode's template must use (a judge that never sees the completion is an error).
REQUIRED_FIELDS = {
    "pointwise": {"completion"},
    "rubric": {"completion"},
    "pairwise": {"completion_a", "completion_b"},
}

_LEAD = " \t*_`#"  # whitespace and markdown emphasis skipped after the marker


def _after_markers(text: str, marker: str) -> list[str]:
    """The rest of the line after each occurrence of `marker` (case-insensitive), markdown and
    whitespace at its start stripped."""
    out = []
    for m in re.finditer(re.escape(marker), text, flags=re.IGNORECASE):
        line = text[m.end() :].split("\n", 1)[0]
        out.append(line.lstrip(_LEAD))
    return out


def parse_score(text: str, *, low: int, high: int, marker: str = "Score:",
                cut: bool = False) -> int | None:  # fmt: skip
    """The integer score in a judge's output, or None when it does not parse (module docstring).

    Rule: after each occurrence of `marker` (case-insensitive) and any whitespace or markdown
    (`* _ ` #`), an integer must come first, optionally followed by "/<high>" ("7/10"); the rest
    of that line holds no other digit; every occurrence gives the same integer; and
    low <= score <= high. With `cut` (the answer stopped at the judge's token budget, no
    end-of-sequence token), an answer `cut_score` says may have been cut inside its number
    ("Score: 1" of a "Score: 10") is None too.

    Examples (low 1, high 10): "Score: 7" → 7; "**Score:** `7`" → 7; "score:  7/10." → 7;
    "7" → None (no marker); "Score: 7 or 8" → None; "Score: 7.5" → None; "Score: 11" → None;
    "Score: I can't rate this" → None; "Score: 3\\nScore: 9" → None; "Score: 3\\nScore: 3" → 3.
    Raises: ValueError when low > high or the marker is empty.
    """
    if low > high:
        raise ValueError(f"parse_score: need low <= high, got low={low}, high={high}")
    if not marker:
        raise ValueError("parse_score: the marker must be non-empty")
    if cut_score(text, cut, low=low, high=high, marker=marker):
        return None  # the budget may have cut the number short
    values = set()
    for rest in _after_markers(text, marker):
        m = re.match(r"([+-]?\d+)(\s*/\s*(\d+))?", rest)
        if m is None:
            return None  # a refusal or prose after the marker
        if m.group(3) is not None and int(m.group(3)) != high:
            return None  # "7/5": not out of this scale
        if re.search(r"\d", rest[m.end() :]):
            return None  # a second number on the line ("7 or 8", "7.5")
        values.add(int(m.group(1)))
    if len(values) != 1:
        return None  # no marker, or conflicting scores
    (score,) = values
    return score if low <= score <= high else None


def parse_choice(text: str, *, marker: str = "Choice:") -> str | None:
    """ "A" or "B" from a pairwise judge's output, or None when it does not parse.

    Rule: after each occurrence of `marker` (case-insensitive) and any whitespace or markdown,
    the letter A or B (either case) must come first as a word ("Choice: A", "**Choice:** B.",
    "choice: Response A" is None: "Response" comes first); the rest of that line names no other
    standalone A/B; every occurrence names the same letter.
    Raises: ValueError for an empty marker.
    """
    if not marker:
        raise ValueError("parse_choice: the marker must be non-empty")
    values = set()
    for rest in _after_markers(text, marker):
        m = re.match(r"([AaBb])\b", rest)
        if m is None:
            return None
        if re.search(r"\b[ABab]\b", rest[m.end() :]):
            return None  # "A or B", "A (B is also fine)"
        values.add(m.group(1).upper())
    if len(values) != 1:
        return None
    return next(iter(values))


def cut_score(text: str, cut: bool, *, low: int, high: int, marker: str = "Score:") -> bool:
    """Whether a judge's answer may have been cut inside its score: `cut` (generation stopped at
    the budget, no end-of-sequence token), the text ends in the integer right after its last
    `marker`, and one more digit would still give a score in [low, high] ("Score: 1" cut, low 1,
    high 10: it may have been "Score: 10"). "Score: 7" cut (70–79 > 10), "Score: 10" cut, and an
    answer that goes on after its number ("Score: 1\\nThe response ...", "Score: 1 ") are not."""
    found = list(re.finditer(re.escape(marker), text, flags=re.IGNORECASE))
    if not cut or not found:
        return False
    m = re.fullmatch(r"[ \t*_`#]*([+-]?\d+)", text[found[-1].end() :])
    return m is not None and any(low <= int(m.group(1) + d) <= high for d in "0123456789")


def check_template(template: str, mode: str, *, field: str = "template") -> None:
    """Raise ConfigError (naming `field`) when `template` names a field `mode` does not fill
    (TEMPLATE_FIELDS), lacks one it must show (REQUIRED_FIELDS), or is not a valid str.format
    string."""
    import string

    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise ConfigError(f"{field}: not a format string: {exc}") from None
    unknown = {n.split(".")[0].split("[")[0] for n in names} - TEMPLATE_FIELDS[mode]
    if unknown or "" in names:
        raise ConfigError(
            f"{field}: unknown field(s) {sorted(unknown) or ['{}']} for mode {mode!r}; "
            f"valid: {', '.join(sorted(TEMPLATE_FIELDS[mode]))}"
        )
    missing = REQUIRED_FIELDS[mode] - names
    if missing:
        raise ConfigError(
            f"{field}: a {mode} template must show {', '.join('{' + m + '}' for m in sorted(missing))}"
        )


def judge_model_path(path: str) -> str:
    """`path/model` when `path` is a run directory (a `model/` folder and no config.json of its
    own), else `path`."""
    import os

    if os.path.isdir(os.path.join(path, "model")) and not os.path.isfile(
        os.path.join(path, "config.json")
    ):
        return os.path.join(path, "model")
    return path


def prompt_text(row) -> str:
    """The prompt of a task Problem or prompt row as plain text for the judge: a string as it is,
    messages as "role: content" lines."""
    prompt = getattr(row, "prompt", None)
    if prompt is None:
        prompt = getattr(row, "question", row)
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


class JudgeScorer:
    """A causal LM judging texts: greedy generation through a rollout engine, outputs cached.

    Args:
        model: a Hugging Face causal LM (put in eval mode, no gradients).
        tokenizer: its tokenizer; the judge prompt is rendered as one user turn with its chat
            template when it has one, else used as plain text.
        judge_id: what identifies the judge in cache keys (path, dtype, budget).
        max_new_tokens: generation budget of the judge's answer (tokens).
        batch_size: judge prompts per `generate` call.
        cache_size: most cached outputs kept (least recently used dropped).
        engine: "hf" (rlhflab's KV-cache sampler) or "vllm" (an offline vLLM `LLM` of its own,
            `rlhflab.rollout.engines.vllm.VLLMEngine.from_model`; needs vLLM installed).
        vllm: the vLLM settings (`rlhflab.config.VLLMConfig`, a run's `rollout.vllm`) for
            engine "vllm", used in `dtype`.
    Counters: `n_generated` (judge prompts the model ran on), `n_cached` (answered from the
    cache), `n_parsed`, `n_failed` (parse results of `score`/`score_rubric`/`choose`).
    """

    def __init__(self, model, tokenizer, *, judge_id: str, max_new_tokens: int = 16,
                 batch_size: int = 32, cache_size: int = 100_000, engine: str = "hf",
                 dtype: str = "float32", vllm=None) -> None:  # fmt: skip
        from rlhflab.rollout.engines import make_engine, stop_ids_for

        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        if engine == "hf":
            self.engine = make_engine(None, self.model, tokenizer)
        elif engine == "vllm":
            from rlhflab.rollout.engines.vllm import VLLMEngine

            if vllm is None:
                raise ConfigError("judge engine 'vllm': no vLLM settings here (a policy-gradient "
                                  "run's rollout.vllm); use engine 'hf'")  # fmt: skip
            if dtype == "float64":
                raise ConfigError("judge engine 'vllm': dtype float64 is not a vLLM dtype")
            vcfg = vllm.model_copy(update={"dtype": dtype})
            self.engine = VLLMEngine.from_model(self.model, tokenizer, vcfg,
                                                stop_token_ids=stop_ids_for(self.model, tokenizer))  # fmt: skip
        else:
            raise ConfigError(f"judge engine: 'hf' or 'vllm', got {engine!r}")
        self.judge_id, self.max_new_tokens = judge_id, max_new_tokens
        self.batch_size, self.cache_size = batch_size, cache_size
        # key -> (decoded answer, cut: no end-of-sequence token within max_new_tokens)
        self.cache: OrderedDict[str, tuple[str, bool]] = OrderedDict()
        self.n_generated = self.n_cached = self.n_parsed = self.n_failed = 0
        self.last_outputs: dict[str, list[str]] = {}  # raw outputs of the last score(_rubric)
        self.last_cut: list[bool] = []  # of the last `generate`'s answers: cut by the budget

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype: str = "float32", **kwargs):
        """Load the judge from a model directory (or a run directory: its `model/`,
        `judge_model_path`), on `device` in `dtype`. Raises ModelError naming the path when it
        cannot be loaded."""
        import os

        from rlhflab.models.loading import load_model, load_tokenizer

        path = judge_model_path(path)
        model = load_model(path, dtype=dtype, device=device)
        tok = load_tokenizer(path)
        max_new, engine = kwargs.get("max_new_tokens", 16), kwargs.get("engine", "hf")
        judge_id = f"{os.path.abspath(path)}|{dtype}|{max_new}|{engine}"
        return cls(model, tok, judge_id=judge_id, dtype=dtype, **kwargs)

    # -- generation, cached ---------------------------------------------------------------------

    def _key(self, template: str, fields: dict) -> str:
        blob = json.dumps([self.judge_id, template, fields], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()

    def generate(self, template: str, requests: list[dict]) -> list[str]:
        """The judge's greedy answer (decoded text) to `template.format(**fields)` for each
        `fields` dict of `requests`; a request seen before (same judge, template and fields) is
        answered from the cache without running the model. `last_cut` says, per answer, whether
        it was cut by `max_new_tokens` (no end-of-sequence token).
        Raises RewardError when a judge prompt does not fit the model's context."""
        from rlhflab.data.formatting import encode_prompt, render_prompt
        from rlhflab.rollout.engines import SamplingParams, sample_chunks

        keys = [self._key(template, f) for f in requests]
        todo = {}  # key -> fields, in first-seen order (duplicates in one call run once)
        for k, f in zip(keys, requests, strict=True):
            if k in self.cache:
                self.cache.move_to_end(k)
            elif k not in todo:
                todo[k] = f
        self.n_cached += len(requests) - len(todo)
        if todo:
            tok = self.tokenizer
            ids = []
            for f in todo.values():
                text = template.format(**f)
                if getattr(tok, "chat_template", None):
                    text = render_prompt(tok, text)
                ids.append(encode_prompt(tok, text))
            limit = getattr(self.model.config, "max_position_embeddings", None)
            longest = max(len(p) for p in ids) + self.max_new_tokens
            if limit is not None and longest > limit:
                raise RewardError(
                    f"judge {self.judge_id.split('|')[0]}: a judge prompt of {longest} tokens "
                    f"(answer budget included) exceeds its context of {limit}"
                )
            params = SamplingParams(n=1, max_new_tokens=self.max_new_tokens, greedy=True)
            outs, cut = [], []
            for _, ro, texts in sample_chunks(
                self.model, self.engine, tok, ids, params, chunk=self.batch_size
            ):
                outs += texts
                cut += [bool(c) for c in ro.truncated.tolist()]
            self.n_generated += len(ids)
            for k, out, c in zip(todo, outs, cut, strict=True):
                self.cache[k] = (out, c)
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        answers = [self.cache[k] for k in keys]
        self.last_cut = [c for _, c in answers]
        return [out for out, _ in answers]

    def _scores(self, outs: list[str], *, low: int, high: int, marker: str) -> list[int | None]:
        """`parse_score` of each answer of the last `generate`, told which the budget cut."""
        return [parse_score(o, low=low, high=high, marker=marker, cut=c)
                for o, c in zip(outs, self.last_cut, strict=True)]  # fmt: skip

    # -- the three modes ------------------------------------------------------------------------

    def score(self, prompts: list[str], completions: list[str], *, low: int = 1, high: int = 10,
              template: str | None = None, marker: str = "Score:") -> list[int | None]:  # fmt: skip
        """Pointwise scores (B ints in [low, high], None where the output does not parse:
        `parse_score`) of `completions` (B) to `prompts` (B)."""
        check_template(template := template or DEFAULT_TEMPLATES["pointwise"], "pointwise")
        reqs = [{"prompt": p, "completion": c, "low": low, "high": high}
                for p, c in zip(prompts, completions, strict=True)]  # fmt: skip
        outs = self.generate(template, reqs)
        self.last_outputs = {"score": outs}
        return self._count(self._scores(outs, low=low, high=high, marker=marker))

    def selection_scores(self, prompts: list[str], completions: list[str]) -> list[float]:
        """Pointwise scores (`score` with the defaults) as floats for picking the best of N
        (`rlhflab.eval.best_of_n.score_pool`): a parse failure is −inf, so a completion the
        judge did not score is chosen only when none of the N was scored."""
        return [float("-inf") if v is None else float(v) for v in self.score(prompts, completions)]

    def score_rubric(self, prompts: list[str], completions: list[str], criteria: list[dict], *,
                     low: int = 1, high: int = 10, template: str | None = None,
                     marker: str = "Score:") -> dict[str, list[int | None]]:  # fmt: skip
        """One pointwise score per criterion ({name: B ints or None}); `criteria` are dicts with
        "name" and optionally "description" (default: the name). Combine them with
        `rubric_total`."""
        check_template(template := template or DEFAULT_TEMPLATES["rubric"], "rubric")
        out, self.last_outputs = {}, {}
        for c in criteria:
            reqs = [{"prompt": p, "completion": y, "low": low, "high": high,
                     "criterion": c["name"], "description": c.get("description") or c["name"]}
                    for p, y in zip(prompts, completions, strict=True)]  # fmt: skip
            outs = self.generate(template, reqs)
            self.last_outputs[c["name"]] = outs
            out[c["name"]] = self._count(self._scores(outs, low=low, high=high, marker=marker))
        return out

    def choose(self, prompts: list[str], completions_a: list[str], completions_b: list[str], *,
               template: str | None = None, marker: str = "Choice:") -> list[str | None]:  # fmt: skip
        """Pairwise choices ("A", "B", or None where the output does not parse: `parse_choice`).
        Swap the two lists and compare for the position bias
        (`rlhflab.eval.agreement.position_bias_rate`)."""
        check_template(template := template or DEFAULT_TEMPLATES["pairwise"], "pairwise")
        reqs = [{"prompt": p, "completion_a": a, "completion_b": b}
                for p, a, b in zip(prompts, completions_a, completions_b, strict=True)]  # fmt: skip
        outs = self.generate(template, reqs)
        return self._count([parse_choice(o, marker=marker) for o in outs])

    def _count(self, parsed: list) -> list:
        failed = sum(v is None for v in parsed)
        self.n_failed += failed
        self.n_parsed += len(parsed) - failed
        return parsed


def rubric_total(scores: dict[str, Tensor], weights: dict[str, float]) -> Tensor:
    """Σ_c w_c s_c / Σ_c w_c over the criteria (each (B,) float; NaN propagates): (B,) float32."""
    total = sum(weights[c] * s for c, s in scores.items())
    return (total / sum(weights[c] for c in scores)).float()


_JUDGES: dict[tuple, JudgeScorer] = {}


def _judge(path: str, device, dtype: str, max_new_tokens: int, batch_size: int,
           engine: str = "hf", vllm=None) -> JudgeScorer:  # fmt: skip
    """The process's judge for these arguments (loaded at the first call, then reused)."""
    from rlhflab.errors import ModelError

    key = (path, str(device), dtype, max_new_tokens, batch_size, engine)
    if key not in _JUDGES:
        try:
            _JUDGES[key] = JudgeScorer.from_pretrained(path, device=device, dtype=dtype,
                                                       max_new_tokens=max_new_tokens,
                                                       batch_size=batch_size, engine=engine,
                                                       vllm=vllm)  # fmt: skip
        except ModelError as exc:
            raise ModelError(f"judge component's args.path: {exc}") from None
    return _JUDGES[key]


def judge_component(
    *,
    texts: list[str],
    problems: list,
    rollout,
    path: str,
    mode: str = "pointwise",
    template: str | None = None,
    marker: str = "Score:",
    low: int = 1,
    high: int = 10,
    criteria: list[dict] | None = None,
    on_parse_failure: str = "error",
    judge_max_new_tokens: int = 16,
    batch_size: int = 32,
    dtype: str = "float32",
    engine: str = "hf",
    vllm=None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Reward component "judge": an LLM judge's score of each completion (module docstring).

    Args:
        texts: decoded completions (B). problems: their prompt rows (B). rollout: the sampled
            batch (its device is the judge's). Supplied by the trainer.
        path: the judge model's directory, or a run directory (its `model/`).
        mode: "pointwise" or "rubric" ("pairwise" compares two completions: not a reward).
        template, marker, low, high: the prompt (DEFAULT_TEMPLATES[mode] when None) and parse
            rule (`parse_score`).
        criteria: rubric only: [{"name", "weight" (default 1), "description"}].
        on_parse_failure: "error", "nan" or "min" (module docstring).
        judge_max_new_tokens, batch_size, dtype: the judge's answer budget (tokens; not the
            policy's `max_new_tokens`), prompts per generate call, parameter dtype.
        engine: "hf" or "vllm" (the judge's own vLLM engine, where vLLM is installed).
        vllm: the run's `rollout.vllm` settings (supplied by the trainer), for engine "vllm".
    Returns:
        (values (B,) float32 on the CPU: scores in [low, high] (rubric: the weighted mean of the
        criteria); extras {"parse_failed": (B,) 0/1, "<criterion>": (B,) per criterion (rubric)}
        logged beside it as `rollout/reward/judge/<key>_mean`, never summed into the reward).
    Raises:
        ConfigError: a bad mode, policy, range, criteria or template (config-time checks in
            `rlhflab.config.sections.JudgeArgs` catch these first).
        RewardError: on_parse_failure "error" and some output did not parse (names the count
            and shows one output).
    """
    if mode not in ("pointwise", "rubric"):
        raise ConfigError(
            f"reward.components[judge].args.mode: a reward is 'pointwise' or 'rubric', got {mode!r}"
        )
    if on_parse_failure not in PARSE_FAILURE_POLICIES:
        raise ConfigError(f"reward.components[judge].args.on_parse_failure: one of "
                          f"{', '.join(PARSE_FAILURE_POLICIES)}, got {on_parse_failure!r}")  # fmt: skip
    judge = _judge(path, rollout.completion_ids.device, dtype, judge_max_new_tokens, batch_size,
                   engine, vllm)  # fmt: skip
    prompts = [prompt_text(r) for r in problems]
    if mode == "pointwise":
        parsed = {"score": judge.score(prompts, texts, low=low, high=high, template=template,
                                       marker=marker)}  # fmt: skip
        weights = {"score": 1.0}
    else:
        crit = criteria or []
        parsed = judge.score_rubric(prompts, texts, crit, low=low, high=high, template=template,
                                    marker=marker)  # fmt: skip
        weights = {c["name"]: float(c.get("weight", 1.0)) for c in crit}
    failed = torch.zeros(len(texts), dtype=torch.bool)
    for values in parsed.values():
        failed |= torch.tensor([v is None for v in values])
    if on_parse_failure == "error" and failed.any():
        row = int(failed.nonzero()[0, 0])
        raise RewardError(
            f"judge {path}: {int(failed.sum())} of {len(texts)} outputs did not parse "
            f"(marker {marker!r}, range [{low}, {high}]); first failure, row {row}: "
            f"{_first_failure(judge, parsed, row)!r}; set on_parse_failure to 'min' or 'nan' "
            "to train through failures"
        )
    fill = float(low) if on_parse_failure == "min" else float("nan")
    scores = {
        name: torch.tensor([fill if v is None else float(v) for v in values], dtype=torch.float32)
        for name, values in parsed.items()
    }
    total = rubric_total(scores, weights)
    extras = {"parse_failed": failed.float()}
    if mode == "rubric":  # each criterion as parsed (NaN where it failed, whatever the policy)
        extras.update({name: torch.tensor([float("nan") if v is None else float(v)
                                           for v in values]) for name, values in parsed.items()})  # fmt: skip
    return total, extras


def _first_failure(judge: JudgeScorer, parsed: dict, row: int) -> str:
    """The first failed raw output of `row` (whitespace collapsed, 120 characters)."""
    name = next(n for n, values in parsed.items() if values[row] is None)
    text = " ".join(judge.last_outputs[name][row].split())[:120]
    return text or "(empty)"

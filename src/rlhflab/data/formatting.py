"""The one place where prompts and completions become text and token ids.

SFT, RL rollouts, DPO and evaluation all go through these functions, so a model is trained and
evaluated on exactly the same prompt/completion boundary.

Why prompt and completion are tokenized *separately* and concatenated:
    With byte-level BPE, tokenizing `prompt + completion` lets the last characters of the prompt
    merge with the first of the completion (a prompt ending in "Answer: " ends in `Ġ`, which merges
    with a following digit or not, depending on the text). Then the ids a policy generates after
    the prompt in RL (prompt ids + sampled ids) would differ from the ids SFT trained on. Encoding
    the two parts separately makes `ids = encode_prompt(p) + encode_completion(c)` hold everywhere
    by construction: SFT labels, the sampler's continuation, DPO's chosen/rejected log-probs and
    eval all see the same prompt ids. With rlhflab's own tokenizer the prompt ends in the special
    token `<|assistant|>`, so the separate encoding also equals the joint one.

Completions carry no eos in their text; `encode_completion` appends `tokenizer.eos_token_id`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from rlhflab.errors import ConfigError, ModelError

AnswerFormat = Literal["tags", "plain", "last_number", "last_line", "boxed"]
ANSWER_FORMATS: tuple[str, ...] = ("tags", "plain", "last_number", "last_line", "boxed")


def check_answer_format(answer_format: str) -> str:
    """Return `answer_format` if valid, else raise `ConfigError` naming `answer_format`."""
    if answer_format not in ANSWER_FORMATS:
        raise ConfigError(
            f"answer_format: must be one of {', '.join(ANSWER_FORMATS)}, got {answer_format!r}"
        )
    return answer_format


#: The sentence `task.instruction: auto` appends to the user message for each answer format that
#: needs the model to write its answer a particular way (`answer_instruction`).
ANSWER_INSTRUCTIONS: dict[str, str] = {
    "tags": "Put your final answer between <answer> and </answer>.",
    "boxed": "Put your final answer in \\boxed{}.",
    "last_number": "End your reply with the final answer as a number.",
    "last_line": "Give the final answer alone on the last line.",
}


def answer_instruction(
    instruction: str, answer_format: str, *, extractor: str | None = None
) -> str | None:
    """The answer-format instruction appended to a task's user message (`task.instruction`).

    Args:
        instruction: "auto": `ANSWER_INSTRUCTIONS[answer_format]`, the sentence that tells the
            model how the extractor reads its answer ("tags" → "Put your final answer between
            <answer> and </answer>."); nothing for "plain" (the whole completion is the answer)
            or when a user `extractor` is set (rlhflab cannot know what it expects). "none":
            nothing. Any other string: used verbatim.
        answer_format: the task's answer format (`ANSWER_FORMATS`).
        extractor: the task's user extractor spec, if any.

    Returns:
        The sentence, or None for no instruction. `render_prompt` puts it after the question,
        separated by one blank line.

    Raises:
        ConfigError: bad `answer_format`, or an empty `instruction`.
    """
    check_answer_format(answer_format)
    if not instruction.strip():
        raise ConfigError("task.instruction: empty; use 'none' for no instruction")
    if instruction == "none":
        return None
    if instruction != "auto":
        return instruction
    if extractor is not None:
        return None
    return ANSWER_INSTRUCTIONS.get(answer_format)


def task_instruction(task: Any) -> str | None:
    """`answer_instruction` of a `TaskConfig` (its instruction, answer_format and extractor)."""
    return answer_instruction(task.instruction, task.answer_format, extractor=task.extractor)


def with_instruction(text: str, instruction: str | None) -> str:
    """`text`, then a blank line and `instruction` when there is one (else `text` unchanged)."""
    return f"{text}\n\n{instruction}" if instruction else text


def render_messages(
    tokenizer: Any, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True
) -> str:
    """Render chat `messages` (`[{"role", "content"}, ...]`) with the tokenizer's chat template.

    Returns:
        The prompt text; with `add_generation_prompt=True` it ends with the assistant header.

    Raises:
        ModelError: the tokenizer has no chat template, or the template rejects the messages.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ModelError(
            "tokenizer has no chat template; use rlhflab's train_tokenizer or an instruct checkpoint"
        )
    try:
        return tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as exc:
        msg = " ".join(str(exc).split()) or type(exc).__name__
        raise ModelError(f"chat template failed: {msg}") from exc


def render_prompt(
    tokenizer: Any, question: str, *, system: str | None = None, instruction: str | None = None
) -> str:
    """Chat-format one question as a prompt that ends where the model's answer starts.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        question: user text (e.g. `Problem.question`).
        system: optional system message, rendered first.
        instruction: optional answer-format instruction (`answer_instruction`), appended to the
            user message after one blank line.

    Returns:
        `apply_chat_template([system?, user], add_generation_prompt=True, tokenize=False)`;
        with rlhflab's tokenizer: "<|system|>…<|end|><|user|>question<|end|><|assistant|>".
    """
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": with_instruction(question, instruction)})
    return render_messages(tokenizer, messages, add_generation_prompt=True)


def format_completion(answer: str, *, answer_format: AnswerFormat) -> str:
    """The target completion text for `answer`: "<answer>42</answer>" (tags), "\\boxed{42}"
    (boxed) or "42" (plain, last_number, last_line: the bare answer is its own last number/line).

    No eos in the text (see `encode_completion`). `rlhflab.rewards.extract_answer` inverts this.
    """
    check_answer_format(answer_format)
    if answer_format == "tags":
        return f"<answer>{answer}</answer>"
    if answer_format == "boxed":
        return f"\\boxed{{{answer}}}"
    return answer


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a rendered prompt, with no special tokens added (the template has them)."""
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def encode_completion(tokenizer: Any, completion: str) -> list[int]:
    """Token ids of a completion followed by `tokenizer.eos_token_id`.

    Raises:
        ModelError: the tokenizer has no eos token.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ModelError("tokenizer has no eos token; completions must end with one")
    return [*tokenizer(completion, add_special_tokens=False)["input_ids"], eos]

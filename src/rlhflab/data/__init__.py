"""Data: reasoning_gym tasks and splits, the prompt/completion format, SFT examples.

* `tasks` — `Problem`, `make_task_dataset`, `make_splits` (leak-free held-out sets).
* `formatting` — the one prompt/completion boundary shared by SFT, RL, DPO and eval.
* `sft` — SFT examples from problems or dataset files (TRL's text / messages / prompt-completion
  rows), and their tokenization with prompt-masked labels.

Importing this package does not import reasoning_gym or transformers.
"""

from rlhflab.data.formatting import (
    encode_completion,
    encode_prompt,
    format_completion,
    render_messages,
    render_prompt,
)
from rlhflab.data.sft import (
    SFTExample,
    load_sft_data,
    load_sft_jsonl,
    sft_examples_from_problems,
    tokenize_sft,
)
from rlhflab.data.tasks import Problem, Splits, make_splits, make_task_dataset, score_answer

__all__ = [
    "Problem",
    "SFTExample",
    "Splits",
    "encode_completion",
    "encode_prompt",
    "format_completion",
    "load_sft_data",
    "load_sft_jsonl",
    "make_splits",
    "make_task_dataset",
    "render_messages",
    "render_prompt",
    "score_answer",
    "sft_examples_from_problems",
    "tokenize_sft",
]

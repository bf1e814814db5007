"""The answer-format instruction (`task.instruction`): its texts, where it goes in the prompt, and
that the quickstart's plain-answer prompts are unchanged."""

import pytest

from rlhflab.config import TaskConfig, config_from_dict
from rlhflab.data.formatting import (
    ANSWER_INSTRUCTIONS,
    answer_instruction,
    render_prompt,
    task_instruction,
)
from rlhflab.data.prompts import PromptRow, render_row
from rlhflab.data.sft import sft_examples_from_problems
from rlhflab.data.tasks import make_splits
from rlhflab.errors import ConfigError

Q = "What is 2 + 3?"


@pytest.mark.parametrize(
    ("answer_format", "instruction", "expected"),
    [
        (
            "tags",
            "auto",
            "<|user|>What is 2 + 3?\n\nPut your final answer between <answer> and </answer>."
            "<|end|><|assistant|>",
        ),
        (
            "boxed",
            "auto",
            "<|user|>What is 2 + 3?\n\nPut your final answer in \\boxed{}.<|end|><|assistant|>",
        ),
        (
            "last_number",
            "auto",
            "<|user|>What is 2 + 3?\n\nEnd your reply with the final answer as a number."
            "<|end|><|assistant|>",
        ),
        (
            "last_line",
            "auto",
            "<|user|>What is 2 + 3?\n\nGive the final answer alone on the last line."
            "<|end|><|assistant|>",
        ),
        ("tags", "none", "<|user|>What is 2 + 3?<|end|><|assistant|>"),
        ("plain", "auto", "<|user|>What is 2 + 3?<|end|><|assistant|>"),
        ("plain", "Answer in one word.", "<|user|>What is 2 + 3?\n\nAnswer in one word.<|end|><|assistant|>"),
        ("tags", "Reply in French.", "<|user|>What is 2 + 3?\n\nReply in French.<|end|><|assistant|>"),
    ],
)  # fmt: skip
def test_instruction_in_the_prompt(tiny_tokenizer, answer_format, instruction, expected):
    task = TaskConfig(answer_format=answer_format, instruction=instruction)
    prompt = render_prompt(tiny_tokenizer, Q, instruction=task_instruction(task))
    assert prompt == expected
    # a task row renders the same way
    assert render_row(tiny_tokenizer, PromptRow(Q), instruction=task_instruction(task)) == expected


def test_instruction_after_system_and_in_messages(tiny_tokenizer):
    tags = ANSWER_INSTRUCTIONS["tags"]
    assert render_prompt(tiny_tokenizer, Q, system="Be brief.", instruction=tags) == (
        "<|system|>Be brief.<|end|><|user|>What is 2 + 3?\n\nPut your final answer between "
        "<answer> and </answer>.<|end|><|assistant|>"
    )
    messages = [{"role": "user", "content": "Hi"}, {"role": "user", "content": Q}]
    assert render_row(tiny_tokenizer, PromptRow(messages), instruction="Be exact.") == (
        "<|user|>Hi<|end|><|user|>What is 2 + 3?\n\nBe exact.<|end|><|assistant|>"
    )
    # a data.template prompt owns the whole text: no instruction is added
    row = PromptRow("User: 2 + 3? Assistant:", rendered=True)
    assert render_row(tiny_tokenizer, row, instruction=tags) == "User: 2 + 3? Assistant:"


def test_auto_adds_nothing_for_a_user_extractor():
    assert answer_instruction("auto", "tags", extractor="my_mod:fn") is None
    assert answer_instruction("Say it plainly.", "tags", extractor="my_mod:fn") == (
        "Say it plainly."
    )
    assert answer_instruction("none", "boxed") is None
    assert TaskConfig().instruction == "auto"


def test_empty_instruction_is_a_config_error():
    with pytest.raises(ConfigError, match=r"task\.instruction.*'none'"):
        config_from_dict(
            {"trainer": "sft", "model": {"name_or_path": "x"}, "task": {"instruction": " "}}
        )
    with pytest.raises(ConfigError, match="answer_format"):
        answer_instruction("auto", "xml")


def test_quickstart_prompts_unchanged(tiny_tokenizer):
    """The quickstart (answer_format plain, instruction auto) renders exactly the prompts it
    rendered before task.instruction existed: its measured results stay comparable."""
    from rlhflab.quickstart import build_configs

    sft_cfg, grpo_cfg = build_configs(fast=False, root=__import__("pathlib").Path("runs"))
    t = grpo_cfg.task
    assert sft_cfg.task == t and t.answer_format == "plain" and t.instruction == "auto"
    splits = make_splits(t.name, config=t.config, n_train=1, n_heldout=1, seed=t.seed)
    expected = "<|user|>Spell this word backward (example: sun -> nus): ohmic<|end|><|assistant|>"
    problem = splits.train[0]
    # RL and held-out eval (render_row) and SFT (render_prompt) prompts
    assert render_row(tiny_tokenizer, problem, instruction=task_instruction(t)) == expected
    (example,) = sft_examples_from_problems(
        [problem], tiny_tokenizer, answer_format=t.answer_format, instruction=task_instruction(t)
    )
    assert example.prompt == expected

"""SFT examples: from problems, from JSONL (both formats, malformed rows), and tokenization."""

import json
from pathlib import Path

import pytest

from rlhflab.data.formatting import encode_completion, encode_prompt, render_messages, render_prompt
from rlhflab.data.sft import (
    DROP_REASONS,
    SFTExample,
    load_sft_jsonl,
    sft_examples_from_problems,
    tokenize_sft,
)
from rlhflab.data.tasks import Problem, make_splits
from rlhflab.errors import ConfigError, DataError

FIXTURES = Path(__file__).parent / "fixtures"
MESSAGES = FIXTURES / "sft_messages.jsonl"
PROMPT_COMPLETION = FIXTURES / "sft_prompt_completion.jsonl"


def test_examples_from_problems(tiny_tokenizer, caplog):
    problems = make_splits("chain_sum", n_train=4, n_heldout=0).train
    no_answer = Problem(question="Is it satisfiable?", answer=None, entry={}, task="x")
    examples = sft_examples_from_problems(
        [*problems, no_answer], tiny_tokenizer, answer_format="tags", system="S"
    )
    assert len(examples) == 4
    assert "skipped 1 problems" in caplog.text
    assert examples[0].prompt == render_prompt(tiny_tokenizer, problems[0].question, system="S")
    assert examples[0].completion == f"<answer>{problems[0].answer}</answer>"
    with pytest.raises(DataError, match="none of the 1 problems has a reference answer"):
        sft_examples_from_problems([no_answer], tiny_tokenizer, answer_format="plain")


def test_messages_format_drop_mode(tiny_tokenizer):
    examples, drops = load_sft_jsonl(MESSAGES, tiny_tokenizer, on_invalid="drop")
    assert len(examples) == 3
    assert examples[0] == SFTExample(
        prompt="<|user|>What is 2 + 2?<|end|><|assistant|>", completion="<answer>4</answer>"
    )
    assert examples[1].prompt == render_messages(
        tiny_tokenizer,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Spell cat backwards."},
        ],
    )
    assert examples[2].prompt == (
        "<|user|>1 + 1?<|end|><|assistant|>2<|end|><|user|>And 2 + 2?<|end|><|assistant|>"
    )
    assert set(drops) == set(DROP_REASONS)
    assert {k: v for k, v in drops.items() if v} == {
        "invalid_json": 1,
        "last_role_not_assistant": 1,
        "empty_completion": 1,
        "bad_role": 1,
        "wrong_type": 1,
    }


def test_prompt_completion_format_drop_mode(tiny_tokenizer):
    examples, drops = load_sft_jsonl(str(PROMPT_COMPLETION), tiny_tokenizer, on_invalid="drop")
    assert [e.completion for e in examples] == ["<answer>8</answer>", "cba", "8"]
    assert examples[0].prompt == render_prompt(tiny_tokenizer, "What is 3 + 5?")
    assert examples[1].prompt == render_prompt(tiny_tokenizer, "Reverse abc.", system="Be brief.")
    assert {k: v for k, v in drops.items() if v} == {
        "missing_field": 1,
        "empty_completion": 1,
        "wrong_type": 1,
        "not_an_object": 1,
    }


def test_error_mode_names_file_and_first_bad_line(tiny_tokenizer):
    with pytest.raises(DataError) as info:
        load_sft_jsonl(MESSAGES, tiny_tokenizer)
    assert str(info.value).startswith(f"data.path: {MESSAGES} line 4: invalid JSON (")
    with pytest.raises(DataError) as info:
        load_sft_jsonl(PROMPT_COMPLETION, tiny_tokenizer)
    assert str(info.value) == (
        f"data.path: {PROMPT_COMPLETION} line 3: field 'completion' is missing "
        "(expected 'text', 'messages' or 'prompt' and 'completion')"
    )


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "hi", "completion": " "}, "field 'completion' is empty"),
        (
            {"prompt": "hi", "completion": 1},
            "field 'completion' must be a string or a list of messages, got int",
        ),
        (
            {"prompt": 3, "completion": "x"},
            "field 'prompt' must be a string or a list of messages, got int",
        ),
        ({"completion": "x"}, "field 'prompt' is missing"),
        (
            {"messages": [{"role": "user", "content": "q"}]},
            "field 'messages[0].role' is 'user'; the last message must be the assistant's",
        ),
        (
            {"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]},
            "field 'messages[0].content' is missing",
        ),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
            "field 'messages[1].content' is empty",
        ),
        ({"messages": "q"}, "field 'messages' must be a list of messages"),
        (
            {"messages": [{"role": "assistant", "content": "a"}]},
            "field 'messages' has no message before the completion",
        ),
        (
            {
                "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "completion": "x",
            },
            "field 'prompt[1].role' is 'assistant'",
        ),
    ],
)
def test_row_errors(tiny_tokenizer, tmp_path, row, message):
    path = tmp_path / "train.jsonl"
    good = {"prompt": "ok", "completion": "fine"}
    path.write_text("\n".join(json.dumps(r) for r in [good, good, row]) + "\n")
    with pytest.raises(DataError) as info:
        load_sft_jsonl(path, tiny_tokenizer)
    assert str(info.value).startswith(f"data.path: {path} line 3: {message}")


def test_file_level_errors(tiny_tokenizer, tmp_path):
    with pytest.raises(DataError, match=r"^data\.path: file not found: "):
        load_sft_jsonl(tmp_path / "missing.jsonl", tiny_tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n\n')
    with pytest.raises(DataError, match=r"has no valid examples \(1 invalid rows dropped\)$"):
        load_sft_jsonl(bad, tiny_tokenizer, on_invalid="drop")
    with pytest.raises(ConfigError, match=r"^data\.on_invalid: "):
        load_sft_jsonl(bad, tiny_tokenizer, on_invalid="skip")


def test_tokenize_sft_masks_exactly_the_prompt(tiny_tokenizer):
    examples = [
        SFTExample(render_prompt(tiny_tokenizer, "What is 12 + 3?"), "<answer>15</answer>"),
        SFTExample(render_prompt(tiny_tokenizer, "Hi", system="S"), "ok"),
    ]
    rows = tokenize_sft(tiny_tokenizer, examples, max_len=64)
    for ex, row in zip(examples, rows, strict=True):
        p_ids = encode_prompt(tiny_tokenizer, ex.prompt)
        c_ids = encode_completion(tiny_tokenizer, ex.completion)
        assert row["input_ids"] == p_ids + c_ids
        assert row["labels"] == [-100] * len(p_ids) + c_ids
        assert row["input_ids"][-1] == tiny_tokenizer.eos_token_id
        assert (
            tiny_tokenizer.decode(row["input_ids"][len(p_ids) :], skip_special_tokens=True)
            == ex.completion
        )


def test_tokenize_sft_truncates_completion_and_rejects_long_prompt(tiny_tokenizer, caplog):
    prompt = render_prompt(tiny_tokenizer, "1 + 1")
    n_prompt = len(encode_prompt(tiny_tokenizer, prompt))
    ex = SFTExample(prompt, "<answer>123456789</answer>")
    (row,) = tokenize_sft(tiny_tokenizer, [ex], max_len=n_prompt + 3)
    assert len(row["input_ids"]) == n_prompt + 3
    assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]
    assert row["input_ids"][-1] != tiny_tokenizer.eos_token_id
    assert "truncated 1 of 1 completions" in caplog.text

    long_prompt = SFTExample(render_prompt(tiny_tokenizer, "9" * 40), "x")
    with pytest.raises(DataError, match=r"^data: prompt of row 1 has \d+ tokens >= max_len 20"):
        tokenize_sft(tiny_tokenizer, [ex, long_prompt], max_len=20)

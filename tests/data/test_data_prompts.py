"""Prompt datasets on real-schema fixtures (GSM8K, MATH, HH-RLHF, UltraFeedback, conversational):
loading, column mapping, held-out dedup, named errors."""

import json
from pathlib import Path

import pytest

from rlhflab.config import PromptDataConfig
from rlhflab.data.prompts import load_prompt_dataset, prompt_key, render_row
from rlhflab.errors import DataError

FIX = str(Path(__file__).parent / "fixtures" / "prompts")


def _data(**kw):
    return PromptDataConfig(source="dataset", **kw)


def test_gsm8k_column_mapping_and_named_heldout_dedup():
    s = load_prompt_dataset(
        _data(
            path=f"{FIX}/gsm8k_train.jsonl",
            prompt_column="question",
            heldout_path=f"{FIX}/gsm8k_test.jsonl",
        )
    )
    assert len(s.train) == 5 and s.train[0].prompt.startswith("Natalia sold clips")
    # Other columns travel with the prompt; the prompt column does not.
    assert s.train[0].columns["answer"].endswith("#### 72") and "question" not in s.train[0].columns
    # Test rows: 4; "Tom had 10 marbles" is a training prompt, the robe question repeats (the
    # second copy differs only by leading spaces).
    assert s.n_heldout_overlap_dropped == 1 and s.n_heldout_internal_dupes_dropped == 1
    assert [r.index for r in s.heldout] == [0, 2]
    train_keys = {prompt_key(r.prompt) for r in s.train}
    assert not any(prompt_key(r.prompt) in train_keys for r in s.heldout)


def test_heldout_fraction_is_seeded_and_disjoint():
    def split(seed):
        return load_prompt_dataset(
            _data(path=f"{FIX}/gsm8k_train.jsonl", prompt_column="question", heldout_frac=0.4),
            seed=seed,
        )

    a, b = split(0), split(0)
    assert [r.index for r in a.heldout] == [r.index for r in b.heldout]
    assert len(a.heldout) == 2 and len(a.train) == 3  # round(0.4 · 5)
    assert {r.index for r in a.train} | {r.index for r in a.heldout} == set(range(5))
    assert {r.index for r in a.train}.isdisjoint({r.index for r in a.heldout})


def test_math_problem_column_keeps_solution():
    s = load_prompt_dataset(
        _data(path=f"{FIX}/math.jsonl", prompt_column="problem", heldout_frac=0)
    )
    assert [r.columns["type"] for r in s.train] == ["Prealgebra", "Algebra", "Algebra"]
    assert "\\boxed{\\frac{3}{4}}" in s.train[0].columns["solution"]
    assert s.heldout == []


def test_hh_rlhf_transcript_prefix(tiny_tokenizer):
    s = load_prompt_dataset(
        _data(
            path=f"{FIX}/hh_rlhf.jsonl",
            prompt_column="chosen",
            prompt_format="hh_transcript",
            heldout_frac=0,
        )
    )
    assert s.train[0].prompt == [{"role": "user", "content": "What is 2 + 2?"}]
    # Multi-turn: every turn before the last assistant turn.
    assert s.train[1].prompt == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Spell cat backwards."},
    ]
    assert s.train[1].columns["rejected"].endswith("Assistant: No.")
    text = render_row(tiny_tokenizer, s.train[1])
    assert text.count("Hello! How can I help?") == 1 and text.endswith(
        tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
        )[-len("<|assistant|>") :]
    )


def test_ultrafeedback_prompt_and_conversational_system_kept(tiny_tokenizer):
    s = load_prompt_dataset(_data(path=f"{FIX}/ultrafeedback.jsonl", heldout_frac=0))
    assert [r.prompt for r in s.train] == [
        "What is 2 + 2?",
        "Spell cat backwards.",
        "Name a primary colour.",
    ]
    assert s.train[0].columns["prompt_id"] == "a1"
    c = load_prompt_dataset(_data(path=f"{FIX}/conversational.jsonl", heldout_frac=0))
    assert c.train[0].prompt[0] == {"role": "system", "content": "Answer in one word."}
    # The data's own system turn wins over data.system; a prompt without one gets data.system.
    kept = render_row(tiny_tokenizer, c.train[0], system="OTHER")
    added = render_row(tiny_tokenizer, c.train[1], system="OTHER")
    assert "Answer in one word." in kept and "OTHER" not in kept
    assert added == tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": "OTHER"}, {"role": "user", "content": "Capital of Italy?"}],
        add_generation_prompt=True,
        tokenize=False,
    )


def test_parquet_through_datasets(tmp_path):
    import datasets

    rows = [json.loads(line) for line in Path(f"{FIX}/gsm8k_train.jsonl").read_text().splitlines()]
    path = tmp_path / "gsm8k.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    s = load_prompt_dataset(_data(path=str(path), prompt_column="question", heldout_frac=0))
    assert [r.prompt for r in s.train] == [r["question"] for r in rows]


def test_errors_name_file_row_and_field(tmp_path):
    with pytest.raises(DataError, match=r"gsm8k_train.jsonl row 0: field 'prompt' is missing"):
        load_prompt_dataset(_data(path=f"{FIX}/gsm8k_train.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"prompt": "ok"}\n{"prompt": [{"role": "user", "content": "q"}, '
        '{"role": "assistant", "content": "a"}]}\n{"prompt": 3}\n'
    )
    with pytest.raises(
        DataError, match=r"bad.jsonl row 1: field 'prompt\[1\].role' is 'assistant'"
    ):
        load_prompt_dataset(_data(path=str(bad)))
    s = load_prompt_dataset(_data(path=str(bad), on_invalid="drop", heldout_frac=0))
    assert len(s.train) == 1 and s.n_invalid_dropped == {"bad_role": 1, "wrong_type": 1}
    with pytest.raises(DataError, match=r"data\.path: file not found"):
        load_prompt_dataset(_data(path=str(tmp_path / "nope.jsonl")))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"prompt": "  "}\n')
    with pytest.raises(DataError, match=r"no training prompts left after filtering"):
        load_prompt_dataset(_data(path=str(empty), on_invalid="drop"))
    # Every held-out prompt is a training prompt: nothing left to evaluate on.
    with pytest.raises(DataError, match=r"no held-out prompts left .*3 were training prompts"):
        load_prompt_dataset(
            _data(
                path=f"{FIX}/math.jsonl", prompt_column="problem", heldout_path=f"{FIX}/math.jsonl"
            )
        )


def test_template_is_used_as_is_for_task_and_dataset_rows(tiny_tokenizer):
    from rlhflab.config import TaskConfig
    from rlhflab.data.prompts import load_prompt_source

    template = "User: {prompt}\nAssistant: <think>"
    data = _data(path=f"{FIX}/gsm8k_train.jsonl", prompt_column="question", template=template)
    s = load_prompt_source(data, seed=0)
    row = s.train[0]
    lines = Path(f"{FIX}/gsm8k_train.jsonl").read_text().splitlines()
    question = json.loads(lines[row.index])["question"]
    assert row.rendered and row.prompt == f"User: {question}\nAssistant: <think>"
    assert render_row(tiny_tokenizer, row, system="ignored") == row.prompt  # no chat template
    task = TaskConfig(name="chain_sum", n_train=5, n_heldout=2)
    t = load_prompt_source(PromptDataConfig(source="task", template=template), task)
    assert t.train[0].prompt == template.replace("{prompt}", t.train[0].problem.question)
    assert t.train[0].columns["answer"] == t.train[0].problem.answer
    with pytest.raises(DataError, match=r"data\.template: row 0 has a conversational prompt"):
        load_prompt_source(_data(path=f"{FIX}/conversational.jsonl", template=template))


def test_heldout_prompt_equal_to_a_training_prompt_up_to_case_is_dropped(tmp_path):
    train = tmp_path / "train.jsonl"
    test = tmp_path / "test.jsonl"
    train.write_text("".join(json.dumps({"q": q}) + "\n" for q in ["Spell bird", "Add 2 and 3"]))
    held = ["SPELL  BIRD", "Add 2 and 3\u00a0", "spell fish", "Spell Fish"]
    test.write_text("".join(json.dumps({"q": q}) + "\n" for q in held))
    s = load_prompt_dataset(_data(path=str(train), prompt_column="q", heldout_path=str(test)))
    # rows 0 and 1 are training prompts up to case / whitespace; row 3 repeats row 2
    assert s.n_heldout_overlap_dropped == 2 and s.n_heldout_internal_dupes_dropped == 1
    assert [r.prompt for r in s.heldout] == ["spell fish"]


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"role": "user", "content": 3}, "field 'prompt[0].content' must be a string, got int"),
        ({"role": "tool", "content": "q"}, "field 'prompt[0].role' is 'tool'; expected one of"),
        ({"role": "user"}, "field 'prompt[0].content' is missing"),
        ("q", "field 'prompt[0]' must be an object with 'role' and 'content'"),
    ],
)
def test_prompt_messages_are_checked_like_preference_and_sft_messages(tmp_path, message, error):
    """One message validator (data/rows.py) for every loader: the same text for the same fault."""
    from rlhflab.data.rows import RowError, check_messages

    with pytest.raises(RowError) as shared:
        check_messages([message], "prompt")
    assert str(shared.value).startswith(error)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [message]}) + "\n")
    with pytest.raises(DataError) as got:
        load_prompt_dataset(_data(path=str(bad)))
    assert str(got.value).endswith(f"bad.jsonl row 0: {shared.value}")

"""TRL's dataset types, standard and conversational, detected per row (SFT) or per file
(preference): fixture files in the real schemas, the exact prompt/completion split, and the loss
mask token by token."""

import copy
import json
from pathlib import Path

import pytest

from rlhflab.data.formatting import encode_completion, encode_prompt, render_messages
from rlhflab.data.preference import (
    PreferencePair,
    UnpairedExample,
    detect_preference_format,
    load_preference_data,
    parse_rows,
    split_shared_text,
    tokenize_pairs,
)
from rlhflab.data.sft import (
    IGNORE_INDEX,
    SFTExample,
    load_sft_data,
    load_sft_jsonl,
    split_features,
    tokenize_sft,
)
from rlhflab.errors import ConfigError, DataError

FIX = Path(__file__).parent / "fixtures"


def _trained_runs(tok, row) -> list[str]:
    """The trained tokens of a tokenized row, decoded run by run (special tokens kept)."""
    runs, cur = [], []
    for i, label in zip(row["input_ids"], row["labels"], strict=True):
        if label == IGNORE_INDEX:
            if cur:
                runs.append(cur)
            cur = []
        else:
            assert label == i
            cur.append(i)
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


# ---------------------------------------------------------------------------------------------
# SFT: language modelling {"text"}
# ---------------------------------------------------------------------------------------------


def test_text_rows_train_every_token(tiny_tokenizer):
    tok = tiny_tokenizer
    examples, drops = load_sft_jsonl(FIX / "sft_text.jsonl", tok, on_invalid="drop")
    assert examples == [
        SFTExample(prompt="", completion="The sky is blue."),
        SFTExample(prompt="", completion="2 + 3 = 5"),
    ]
    assert {k: v for k, v in drops.items() if v} == {"empty_completion": 1, "wrong_type": 2}
    with pytest.raises(DataError, match=r"sft_text\.jsonl line 3: field 'text' is empty$"):
        load_sft_jsonl(FIX / "sft_text.jsonl", tok)
    rows = tokenize_sft(tok, examples, max_len=64)
    for ex, row in zip(examples, rows, strict=True):
        ids = tok(ex.completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert tok.bos_token_id is None  # no bos: the first token is context only
        assert row["input_ids"] == ids
        assert row["labels"] == [IGNORE_INDEX, *ids[1:]]
        first = tok.decode(ids[:1])
        assert _trained_runs(tok, row) == [ex.completion[len(first) :] + "<|end|>"]


def test_text_row_with_bos_trains_the_first_token(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"bos_token": "<|bos|>"})
    (row,) = tokenize_sft(tok, [SFTExample("", "2 + 3 = 5")], max_len=64)
    ids = tok("2 + 3 = 5", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert row["input_ids"] == [tok.bos_token_id, *ids]
    assert row["labels"] == [IGNORE_INDEX, *ids]
    assert split_features(row) == ([tok.bos_token_id], ids, [1] * len(ids))


# ---------------------------------------------------------------------------------------------
# SFT: conversational language modelling {"messages"}: every assistant turn, or the last
# ---------------------------------------------------------------------------------------------

MULTI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "1 + 1?"},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "And 2 + 2?"},
    {"role": "assistant", "content": "4"},
]


def test_messages_train_every_assistant_turn_token_by_token(tiny_tokenizer):
    tok = tiny_tokenizer
    examples, _ = load_sft_jsonl(FIX / "sft_multiturn.jsonl", tok)
    ex = examples[0]
    assert ex.prompt == render_messages(tok, MULTI[:-1])
    assert ex.completion == "4"
    head = "<|system|>Be brief.<|end|><|user|>1 + 1?<|end|><|assistant|>"
    assert ex.trained_spans == ((len(head), len(head) + 1),)
    (row,) = tokenize_sft(tok, [ex], max_len=64)
    c1 = encode_prompt(tok, head)
    a1 = encode_completion(tok, "2")
    c2 = encode_prompt(tok, "<|user|>And 2 + 2?<|end|><|assistant|>")
    a2 = encode_completion(tok, "4")
    assert row["input_ids"] == c1 + a1 + c2 + a2
    assert row["labels"] == [IGNORE_INDEX] * len(c1) + a1 + [IGNORE_INDEX] * len(c2) + a2
    # The ids are the chat template's rendering of the whole conversation, tokenized at once.
    full = render_messages(tok, MULTI, add_generation_prompt=False)
    assert row["input_ids"] == tok(full, add_special_tokens=False)["input_ids"]
    assert _trained_runs(tok, row) == ["2<|end|>", "4<|end|>"]
    # prompt = context before the first trained token; the mask covers turn 1 and turn 2 only
    prompt, completion, mask = split_features(row)
    assert prompt == c1 and completion == a1 + c2 + a2
    assert mask == [1] * len(a1) + [0] * len(c2) + [1] * len(a2)

    # three assistant turns: three trained runs, each the content + eos
    rows = tokenize_sft(tok, examples, max_len=64)
    assert _trained_runs(tok, rows[1]) == ["Hello<|end|>"]
    assert _trained_runs(tok, rows[2]) == ["7<|end|>", "14<|end|>", "13<|end|>"]


def test_ultrachat_row_prompt_column_is_informative(tiny_tokenizer, tmp_path):
    from datasets import Dataset

    row = {"prompt": "1 + 1?", "prompt_id": "ab12", "messages": MULTI[1:]}
    Dataset.from_list([row]).to_parquet(tmp_path / "ultrachat.parquet")
    (ex,), _ = load_sft_data(tmp_path / "ultrachat.parquet", tiny_tokenizer)
    assert ex.prompt == render_messages(tiny_tokenizer, MULTI[1:-1]) and ex.completion == "4"
    assert len(ex.trained_spans) == 1
    path = tmp_path / "both.jsonl"
    path.write_text(json.dumps({"messages": MULTI, "completion": "4"}) + "\n")
    with pytest.raises(DataError, match=r"line 1: has both 'messages' and 'completion'; use one"):
        load_sft_jsonl(path, tiny_tokenizer)


def test_messages_last_turn_only(tiny_tokenizer):
    tok = tiny_tokenizer
    examples, _ = load_sft_jsonl(FIX / "sft_multiturn.jsonl", tok, assistant_turns="last")
    assert examples[0] == SFTExample(render_messages(tok, MULTI[:-1]), "4")
    rows = tokenize_sft(tok, examples, max_len=64)
    assert [_trained_runs(tok, r) for r in rows] == [["4<|end|>"], ["Hello<|end|>"], ["13<|end|>"]]
    with pytest.raises(ConfigError, match=r"^data\.assistant_turns: "):
        load_sft_jsonl(FIX / "sft_multiturn.jsonl", tok, assistant_turns="first")


def test_truncation_keeps_whole_trained_prefix(tiny_tokenizer):
    tok = tiny_tokenizer
    examples, _ = load_sft_jsonl(FIX / "sft_multiturn.jsonl", tok)
    (full,) = tokenize_sft(tok, examples[2:], max_len=128)
    first_runs = _trained_runs(tok, full)
    # cut inside the second user turn: the untrained tail is dropped, turn 1 stays trained
    n_turn1 = full["labels"].index(IGNORE_INDEX, full["labels"].index(tok.eos_token_id) - 1)
    (cut,) = tokenize_sft(tok, examples[2:], max_len=n_turn1 + 2)
    assert cut["input_ids"] == full["input_ids"][:n_turn1]
    assert _trained_runs(tok, cut) == first_runs[:1]


def test_chatml_style_template_newline_after_eos_is_context(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    )
    examples, _ = load_sft_jsonl(FIX / "sft_multiturn.jsonl", tok)
    (row,) = tokenize_sft(tok, examples[:1], max_len=64)
    assert _trained_runs(tok, row) == ["2<|end|>", "4<|end|>"]
    full = render_messages(tok, MULTI, add_generation_prompt=False)
    assert full.endswith("4<|end|>\n")
    assert tok.decode(row["input_ids"], skip_special_tokens=False) == full[:-1]
    c2 = encode_prompt(tok, "\n<|user|>\nAnd 2 + 2?<|end|>\n<|assistant|>\n")
    a2 = encode_completion(tok, "4")
    assert row["input_ids"][-len(c2 + a2) :] == c2 + a2
    assert row["labels"][-len(c2 + a2) :] == [IGNORE_INDEX] * len(c2) + a2


def test_template_that_rewrites_earlier_turns_is_an_error(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    # Renders earlier assistant turns without their content (as templates that strip reasoning
    # from past turns do): the trained spans could not line up with the rendered text.
    tok.chat_template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}"
        "{% if m['role'] == 'assistant' and not loop.last %}{% else %}{{ m['content'] }}{% endif %}"
        "{{ '<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    with pytest.raises(DataError, match=r"line 1: field 'messages\[2\]': the chat template"):
        load_sft_jsonl(FIX / "sft_multiturn.jsonl", tok)
    examples, drops = load_sft_jsonl(FIX / "sft_multiturn.jsonl", tok, on_invalid="drop")
    assert len(examples) == 1 and drops["template_mismatch"] == 2
    examples, _ = load_sft_jsonl(FIX / "sft_multiturn.jsonl", tok, assistant_turns="last")
    assert len(examples) == 3


# ---------------------------------------------------------------------------------------------
# SFT: conversational prompt-completion
# ---------------------------------------------------------------------------------------------


def test_conversational_prompt_completion(tiny_tokenizer):
    tok = tiny_tokenizer
    examples, drops = load_sft_jsonl(FIX / "sft_conversational_pc.jsonl", tok, on_invalid="drop")
    assert examples == [
        SFTExample("<|user|>What is 3 + 5?<|end|><|assistant|>", "8"),
        SFTExample("<|system|>Be brief.<|end|><|user|>Reverse abc.<|end|><|assistant|>", "cba"),
    ]
    assert {k: v for k, v in drops.items() if v} == {
        "bad_role": 1,
        "empty_completion": 1,
        "wrong_type": 1,
    }
    with pytest.raises(
        DataError, match=r"line 3: field 'completion' must be one assistant message"
    ):
        load_sft_jsonl(FIX / "sft_conversational_pc.jsonl", tok)
    (row,) = tokenize_sft(tok, examples[:1], max_len=64)
    p = encode_prompt(tok, examples[0].prompt)
    assert row["labels"] == [IGNORE_INDEX] * len(p) + encode_completion(tok, "8")


# ---------------------------------------------------------------------------------------------
# SFT from parquet / csv / json / a dataset directory (the Hub-id code path)
# ---------------------------------------------------------------------------------------------


def test_sft_from_parquet_csv_json_and_dataset_dir(tiny_tokenizer, tmp_path):
    from datasets import Dataset

    tok = tiny_tokenizer
    rows = [
        {"prompt": "What is 3 + 5?", "completion": "<answer>8</answer>"},
        {"prompt": "2 + 2?", "completion": "4"},  # csv: stays the text "4"
    ]
    want, _ = load_sft_jsonl(FIX / "sft_prompt_completion.jsonl", tok, on_invalid="drop")
    Dataset.from_list(rows).to_parquet(tmp_path / "sft.parquet")
    Dataset.from_list(rows).to_csv(tmp_path / "sft.csv", index=False)
    (tmp_path / "sft.json").write_text(json.dumps(rows))
    (tmp_path / "hub" / "data").mkdir(parents=True)
    Dataset.from_list(rows).to_parquet(tmp_path / "hub" / "data" / "train-00000-of-00001.parquet")
    for path in ("sft.parquet", "sft.csv", "sft.json", "hub"):
        examples, drops = load_sft_data(tmp_path / path, tok)
        assert examples[0] == want[0]
        assert examples[1].completion == "4" and sum(drops.values()) == 0

    texts = [{"text": "The sky is blue."}, {"text": ""}, {"text": "2 + 3 = 5"}]
    Dataset.from_list(texts).to_parquet(tmp_path / "lm.parquet")
    with pytest.raises(DataError) as info:
        load_sft_data(tmp_path / "lm.parquet", tok)
    assert str(info.value) == f"data.path: {tmp_path / 'lm.parquet'} row 1: field 'text' is empty"
    examples, drops = load_sft_data(tmp_path / "lm.parquet", tok, on_invalid="drop")
    assert [e.completion for e in examples] == ["The sky is blue.", "2 + 3 = 5"]
    assert drops["empty_completion"] == 1
    with pytest.raises(DataError, match=r"^data\.path: file not found: .*missing\.parquet"):
        load_sft_data(tmp_path / "missing.parquet", tok)
    with pytest.raises(DataError, match=r"^data\.path: cannot load .*split 'test'"):
        load_sft_data(tmp_path / "hub", tok, split="test")
    Dataset.from_list([{"text": ""}]).to_parquet(tmp_path / "empty.parquet")
    with pytest.raises(DataError, match=r"has no valid examples \(1 invalid rows dropped\)$"):
        load_sft_data(tmp_path / "empty.parquet", tok, on_invalid="drop")


# ---------------------------------------------------------------------------------------------
# Preference: implicit prompt as plain strings; detection of every format
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chosen", "rejected", "split"),
    [
        ("The sky is blue.", "The sky is green.", ("The sky is", " blue.", " green.")),
        ("The cat sat", "The car sat", ("The", " cat sat", " car sat")),
        ("Q: 2 + 2?\nA: 4", "Q: 2 + 2?\nA: 5", ("Q: 2 + 2?\nA:", " 4", " 5")),
        ("Q?\n\nA", "Q?\n\nB", ("Q?", "\n\nA", "\n\nB")),
        ("Q? A", "Q?\nB", ("Q?", " A", "\nB")),
        ("Hello world", "Hello world!!", ("Hello", " world", " world!!")),
        ("Hello world", "Hello world again", ("Hello", " world", " world again")),
    ],
)
def test_split_shared_text(chosen, rejected, split):
    assert split_shared_text(chosen, rejected) == split
    prompt, c, r = split
    assert prompt + c == chosen and prompt + r == rejected


def test_implicit_string_pairs_fixture(tiny_tokenizer):
    path = str(FIX / "pref_implicit.jsonl")
    pairs, drops = load_preference_data(path, "auto", on_invalid="drop")
    assert pairs == [
        PreferencePair("The sky is", " blue.", " green."),
        PreferencePair("Q: 2 + 2?\nA:", " 4", " 5"),
        PreferencePair("The", " cat sat", " car sat"),
    ]
    assert {k: v for k, v in drops.items() if v} == {
        "identical": 1,
        "no_shared_prompt": 1,
        "wrong_type": 1,
    }
    assert load_preference_data(path, "implicit", on_invalid="drop") == (pairs, drops)
    with pytest.raises(
        DataError, match=r"implicit\.jsonl row 3: fields 'chosen' and 'rejected' are id"
    ):
        load_preference_data(path, "auto")
    # A string prompt is raw text (no chat template): the ids are exactly prompt + completion.
    tok = tiny_tokenizer
    (t,), _ = tokenize_pairs(tok, pairs[:1])
    assert t.prompt_ids == tok("The sky is", add_special_tokens=False)["input_ids"]
    assert t.chosen_ids == tok(" blue.", add_special_tokens=False)["input_ids"] + [1]
    assert t.rejected_ids == tok(" green.", add_special_tokens=False)["input_ids"] + [1]
    assert tok.decode(t.prompt_ids + t.chosen_ids[:-1]) == "The sky is blue."


@pytest.mark.parametrize(
    ("fixture", "fmt"),
    [
        ("pref_pairs.jsonl", "pairs"),
        ("pref_ultrafeedback.jsonl", "implicit"),
        ("pref_hh_rlhf.jsonl", "hh_rlhf"),
        ("pref_unpaired.jsonl", "unpaired"),
        ("pref_implicit.jsonl", "implicit"),
    ],
)
def test_auto_detects_each_format(fixture, fmt):
    path = str(FIX / fixture)
    first = json.loads((FIX / fixture).read_text().splitlines()[0])
    assert detect_preference_format(first) == fmt
    assert load_preference_data(path, "auto", on_invalid="drop") == load_preference_data(
        path, fmt, on_invalid="drop"
    )


def test_ultrafeedback_name_is_an_alias_of_implicit():
    path = str(FIX / "pref_ultrafeedback.jsonl")
    kw = {"on_invalid": "drop"}
    uf = load_preference_data(path, "ultrafeedback", **kw)
    assert uf == load_preference_data(path, "implicit", **kw) == load_preference_data(path, **kw)
    assert uf[0][0] == PreferencePair([{"role": "user", "content": "What is 2 + 2?"}], "4", "5")


def test_auto_detection_errors_and_no_silent_switch():
    with pytest.raises(DataError, match=r"^src: cannot detect the preference format"):
        parse_rows([{"question": "x"}, 3], "auto", source="src")
    # The first row decides: a later row in another format is an error naming its field.
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"chosen": "x y", "rejected": "x z"}]
    with pytest.raises(DataError, match=r"^src row 1: field 'prompt' is missing$"):
        parse_rows(rows, "auto", source="src")
    # rows that are not objects are skipped by detection and counted when dropped
    pairs, drops = parse_rows([7, *rows[:1]], "auto", on_invalid="drop")
    assert pairs == [PreferencePair([{"role": "user", "content": "p"}], "a", "b")]
    assert drops["not_an_object"] == 1


def test_conversational_unpaired_and_explicit_pairs_detected():
    user = [{"role": "user", "content": "2 + 2?"}]
    kto = {"prompt": user, "completion": [{"role": "assistant", "content": "4"}], "label": 1}
    (ex,), _ = parse_rows([kto], "auto")
    assert ex == UnpairedExample(user, "4", True)
    conv = {"prompt": user, "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"}
    assert detect_preference_format(conv) == "pairs"
    assert parse_rows([conv], "auto")[0] == [PreferencePair(user, "4", "5")]

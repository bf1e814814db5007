"""Preference loaders on fixture files in the real schemas; errors name row and field."""

import random
from pathlib import Path

import pytest

from rlhflab.data.preference import (
    PreferencePair,
    UnpairedExample,
    load_preference_data,
    pairs_from_scored_samples,
    parse_hh_transcript,
    parse_rows,
    tokenize_pairs,
    truncate_prompt,
    unpair,
)
from rlhflab.errors import DataError

FIX = Path(__file__).parent / "fixtures"


def test_ultrafeedback_rows_and_malformed_row():
    with pytest.raises(DataError, match=r"row 2: field 'rejected\[1\]\.content' must be a string"):
        load_preference_data(str(FIX / "pref_ultrafeedback.jsonl"), "ultrafeedback")
    pairs, drops = load_preference_data(
        str(FIX / "pref_ultrafeedback.jsonl"), "ultrafeedback", on_invalid="drop"
    )
    assert drops["wrong_type"] == 1 and sum(drops.values()) == 1
    assert pairs[0] == PreferencePair([{"role": "user", "content": "What is 2 + 2?"}], "4", "5")
    assert pairs[1].chosen == "tac" and pairs[1].rejected == "cat"


def test_hh_rlhf_multiturn_shared_prefix_is_prompt():
    with pytest.raises(DataError, match=r"row 2: field 'chosen' is not a"):
        load_preference_data(str(FIX / "pref_hh_rlhf.jsonl"), "hh_rlhf")
    pairs, drops = load_preference_data(
        str(FIX / "pref_hh_rlhf.jsonl"), "hh_rlhf", on_invalid="drop"
    )
    assert drops["bad_transcript"] == 1 and drops["identical"] == 1 and len(pairs) == 2
    assert pairs[0].prompt == [{"role": "user", "content": "What is 2 + 2?"}]
    assert (pairs[0].chosen, pairs[0].rejected) == ("4", "I don't know.")
    assert pairs[1].prompt == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Spell cat backwards."},
    ]
    assert (pairs[1].chosen, pairs[1].rejected) == ("tac", "No.")


def test_hh_pair_differing_before_last_turn_is_rejected():
    row = {
        "chosen": "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant: d",
        "rejected": "\n\nHuman: a\n\nAssistant: x\n\nHuman: c\n\nAssistant: d",
    }
    with pytest.raises(DataError, match=r"row 0: field 'chosen' differs .* before its last"):
        parse_rows([row], "hh_rlhf")
    assert parse_hh_transcript("\n\nHuman: hi\n\nAssistant:", "chosen")[-1] == {
        "role": "assistant",
        "content": "",
    }


def test_generic_pairs_string_and_messages():
    with pytest.raises(DataError, match=r"row 2: field 'rejected' is missing"):
        load_preference_data(str(FIX / "pref_pairs.jsonl"), "pairs")
    pairs, drops = load_preference_data(str(FIX / "pref_pairs.jsonl"), "pairs", on_invalid="drop")
    assert drops["missing_field"] == 1
    assert pairs[0].prompt == [{"role": "user", "content": "What is 2 + 2?"}]
    assert pairs[1].prompt[0] == {"role": "system", "content": "Be brief."}
    assert (pairs[1].chosen, pairs[1].rejected) == ("6", "7")
    # a full conversation as chosen: the prompt prefix is stripped
    row = {
        "prompt": "q",
        "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        "rejected": "b",
    }
    assert parse_rows([row], "pairs")[0][0].chosen == "a"


def test_unpaired_rows_and_bad_label():
    with pytest.raises(DataError, match=r"row 2: field 'label' must be true/false"):
        load_preference_data(str(FIX / "pref_unpaired.jsonl"), "unpaired")
    rows, drops = load_preference_data(
        str(FIX / "pref_unpaired.jsonl"), "unpaired", on_invalid="drop"
    )
    assert drops["bad_label"] == 1
    assert [r.label for r in rows] == [True, False] and rows[0].completion == "4"


def test_parquet_through_datasets(tmp_path):
    import datasets

    rows = [{"prompt": "2+2?", "chosen": "4", "rejected": "5"}] * 3
    path = tmp_path / "p.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    pairs, _ = load_preference_data(str(path), "pairs", max_rows=2)
    assert len(pairs) == 2 and pairs[0].chosen == "4"


def test_missing_file_and_no_valid_rows(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        load_preference_data(str(tmp_path / "nope.jsonl"), "pairs")
    with pytest.raises(DataError, match="no valid pairs rows"):
        parse_rows([{"prompt": "a"}], "pairs", on_invalid="drop")


def test_unpair():
    out = unpair([PreferencePair("p", "good", "bad")])
    assert out == [UnpairedExample("p", "good", True), UnpairedExample("p", "bad", False)]


def test_pairs_from_scored_samples():
    rng = random.Random(0)
    prompts = ["p0", "p1", "p2"]
    samples = [["a", "b", "c"], ["x", "y", "z"], ["m", "n", "o"]]
    scores = [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    gold = ["A", "X", "M"]
    pairs, counts = pairs_from_scored_samples(
        prompts, samples, scores, gold=gold, chosen_source="sampled_or_gold", rng=rng
    )
    # p0: best sample 'a' vs a wrong one; p1: gold 'X' vs a wrong one; p2: all correct -> gold vs
    # a correct sample would be no contrast... gold counts as better, so it pairs unless equal text
    assert pairs[0].chosen == "a" and pairs[0].rejected in ("b", "c")
    assert pairs[1].chosen == "X" and pairs[1].rejected in ("x", "y", "z")
    assert counts["prompts"] == 3
    pairs, counts = pairs_from_scored_samples(prompts, samples, scores, chosen_source="sampled")
    assert [p.prompt for p in pairs] == ["p0"] and counts["no_contrast"] == 2


def test_tokenize_pairs_truncation(tiny_tokenizer):
    tok = tiny_tokenizer
    long_q = "What is " + " + ".join(["1"] * 30) + "?"
    pairs = [PreferencePair([{"role": "user", "content": long_q}], "30", "31" * 20)]
    full, counts = tokenize_pairs(tok, pairs)
    assert counts == {"prompt_truncated": 0, "completion_truncated": 0}
    assert full[0].chosen_ids[-1] == tok.eos_token_id
    cut, counts = tokenize_pairs(
        tok, pairs, max_prompt_len=10, max_completion_len=5, truncation_side="left"
    )
    assert cut[0].prompt_ids == full[0].prompt_ids[-10:]  # keeps the end (assistant header)
    assert cut[0].rejected_ids == full[0].rejected_ids[:5]
    assert cut[0].chosen_ids == full[0].chosen_ids  # short enough: untouched
    assert counts == {"prompt_truncated": 1, "completion_truncated": 1}
    assert truncate_prompt([1, 2, 3, 4], 2, "right") == [1, 2]

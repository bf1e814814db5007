"""GSM8K loader on a fixture in the real schema; numeric answer scoring through the Verifier."""

from pathlib import Path

import pytest

from rlhflab.data.gsm8k import load_gsm8k, parse_number
from rlhflab.errors import DataError
from rlhflab.rewards.verifier import Verifier

FIXTURE = str(Path(__file__).parent / "fixtures" / "gsm8k.jsonl")


def test_load_gsm8k_drop_counts_and_answers():
    problems, drops = load_gsm8k(FIXTURE, on_invalid="drop")
    assert [p.answer for p in problems] == ["72", "2400"]
    assert drops == {"missing_field": 1, "wrong_type": 0, "no_final_answer": 1}
    assert problems[0].entry["steps"][0] == "Natalia sold 48/2 = 24 clips in May."
    v = Verifier(answer_format="tags")
    assert v.score("so <answer>72</answer>", problems[0]) == 1.0
    assert v.score("<answer>2,400</answer>", problems[1]) == 1.0
    assert v.score("<answer>71</answer>", problems[0]) == 0.0
    assert v.score("<answer>lots</answer>", problems[0]) == 0.0


def test_load_gsm8k_error_names_row_and_field():
    with pytest.raises(DataError, match="row 2: field 'answer' is missing"):
        load_gsm8k(FIXTURE)


def test_parse_number():
    assert parse_number("1,234") == 1234 and parse_number("$5") == 5 and parse_number("7.") == 7
    assert parse_number("3.50") == parse_number("3.5") and parse_number("x") is None

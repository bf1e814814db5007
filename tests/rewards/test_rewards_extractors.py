"""Answer extractors for models that answer in sentences: last number, last line, boxed, a user
function; and the majority-answer baseline."""

import sys
import types

import pytest

from rlhflab.config import config_from_dict
from rlhflab.data.formatting import format_completion
from rlhflab.data.tasks import make_splits
from rlhflab.errors import ConfigError
from rlhflab.eval.accuracy import majority_baseline
from rlhflab.rewards.verifier import Verifier, extract_answer


@pytest.mark.parametrize(
    ("text", "fmt", "expected"),
    [
        ("There are 4 legs per dog, so the answer is 68.", "last_number", "68"),
        ("3 + 4 = 7", "last_number", "7"),
        ("It is -12.5 degrees", "last_number", "-12.5"),
        ("a total of 1,234 apples", "last_number", "1234"),
        ("no digits here", "last_number", None),
        ("Let me think.\nStep 1.\n  drib  \n\n", "last_line", "drib"),
        ("   \n  ", "last_line", None),
        ("so \\boxed{12} and then \\boxed{\\frac{1}{2}}", "boxed", "\\frac{1}{2}"),
        ("\\boxed{ 5 }", "boxed", "5"),
        ("\\boxed{unclosed", "boxed", None),
        ("the answer is 5", "boxed", None),
    ],
)
def test_extractors(text, fmt, expected):
    assert extract_answer(text, answer_format=fmt) == expected


@pytest.mark.parametrize("fmt", ["tags", "plain", "last_number", "last_line", "boxed"])
def test_format_completion_round_trips(fmt):
    assert extract_answer(format_completion("42", answer_format=fmt), answer_format=fmt) == "42"


@pytest.fixture
def basic_arithmetic():
    return make_splits("basic_arithmetic", n_train=20, n_heldout=5, seed=0).heldout[0]


def test_sentence_answers_score_with_last_number(basic_arithmetic):
    text = f"Let me compute. The result is {basic_arithmetic.answer}."
    assert Verifier(answer_format="plain").score(text, basic_arithmetic) == 0.0
    assert Verifier(answer_format="last_number").score(text, basic_arithmetic) == 1.0


def test_user_extractor(basic_arithmetic, monkeypatch):
    mod = types.ModuleType("my_extractors")
    mod.after_colon = lambda text: text.split("ANSWER:")[-1] if "ANSWER:" in text else None
    mod.broken = lambda text: 1 / 0
    monkeypatch.setitem(sys.modules, "my_extractors", mod)
    v = Verifier(answer_format="plain", extractor="my_extractors:after_colon")
    assert v.score(f"blah ANSWER: {basic_arithmetic.answer} ", basic_arithmetic) == 1.0
    assert v.score("no marker", basic_arithmetic) == 0.0 and v.n_no_answer == 1
    broken = Verifier(answer_format="plain", extractor="my_extractors:broken")
    assert broken.score("x", basic_arithmetic) == 0.0 and broken.n_no_answer == 1


def test_bad_extractor_is_a_config_error():
    with pytest.raises(ConfigError, match=r"task\.extractor"):
        config_from_dict(
            {"trainer": "sft", "model": {"name_or_path": "x"}, "task": {"extractor": "nope:fn"}}
        )
    with pytest.raises(ConfigError, match="module:function"):
        Verifier(extractor="no_colon")


class _P:  # a Problem stand-in scored by exact match
    def __init__(self, answer):
        self.answer = answer

    def score(self, given):
        return 1.0 if given == self.answer else 0.0


def test_majority_baseline_by_hand():
    train = [_P("1"), _P("1"), _P("2"), _P("1"), _P(None)]
    heldout = [_P("1"), _P("3"), _P("1"), _P("1")]
    v = Verifier(answer_format="plain")
    res = majority_baseline(train, heldout, v)
    # "1" is right on 3 of 4: mean 0.75, stderr sqrt(0.75·0.25/(4-1)) = 0.25
    assert res["majority_answer"] == "1"
    assert res["majority_accuracy"] == 0.75
    assert res["majority_accuracy_stderr"] == pytest.approx(0.25)
    assert v.n_scored == 0  # the baseline does not count as scored completions

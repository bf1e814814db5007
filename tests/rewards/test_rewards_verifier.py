"""Answer extraction and verifiable rewards (binary vs partial, raising verifiers)."""

import pytest

from rlhflab.data.tasks import make_splits
from rlhflab.errors import ConfigError
from rlhflab.rewards.verifier import Verifier, extract_answer


@pytest.mark.parametrize(
    ("text", "fmt", "expected"),
    [
        ("<answer>1</answer> then <answer> 42 </answer>", "tags", "42"),
        ("thinking... <answer>\n-7\n</answer><|end|>", "tags", "-7"),
        ("no tags 42", "tags", None),
        ("<answer>   </answer>", "tags", None),
        ("<answer>4", "tags", None),
        (" 42 \n", "plain", "42"),
        ("  ", "plain", None),
    ],
)
def test_extract_answer(text, fmt, expected):
    assert extract_answer(text, answer_format=fmt) == expected


@pytest.fixture(scope="module")
def arithmetic_problem():
    return make_splits("basic_arithmetic", n_train=1, n_heldout=0, seed=1).train[0]


def test_whitespace_is_stripped_before_scoring(arithmetic_problem):
    p = arithmetic_problem  # "Calculate 5 - 3 - 6." -> "-4"
    assert p.answer == "-4"
    assert p.score(" -4 ") == pytest.approx(0.5)  # the trap: partial credit for whitespace
    assert Verifier(answer_format="plain", reward="partial").score(" -4 ", p) == 1.0
    assert Verifier(answer_format="tags").score("<answer> -4 </answer>", p) == 1.0


def test_binary_vs_partial(arithmetic_problem):
    p = arithmetic_problem
    partial = Verifier(answer_format="tags", reward="partial")
    binary = Verifier(answer_format="tags", reward="binary")
    # Reference "-4" is a substring of "-4.0": reasoning_gym gives len("-4") / len("-4.0").
    assert partial.score("<answer>-4.0</answer>", p) == pytest.approx(0.5)
    assert binary.score("<answer>-4.0</answer>", p) == 0.0
    assert binary.score("<answer>-4</answer>", p) == 1.0
    assert binary.score("<answer>5</answer>", p) == 0.0


def test_counters_and_raising_verifier(arithmetic_problem):
    pf = make_splits("prime_factorization", n_train=1, n_heldout=0).train[0]
    with pytest.raises(ValueError):
        pf.score("abc")  # reasoning_gym raises on non-numeric answers
    v = Verifier(answer_format="tags", reward="binary")
    scores = v.score_batch(
        [
            "<answer>abc</answer>",
            "no answer",
            f"<answer>{pf.answer}</answer>",
            "<answer>-4</answer>",
        ],
        [pf, pf, pf, arithmetic_problem],
    )
    assert scores == [0.0, 0.0, 1.0, 1.0]
    assert v.counters() == {"n_scored": 4, "n_errors": 1, "n_no_answer": 1}
    v.reset_counters()
    assert v.n_scored == v.n_errors == v.n_no_answer == 0
    with pytest.raises(ValueError, match="2 completions but 1 problems"):
        v.score_batch(["a", "b"], [pf])


def test_bad_options():
    with pytest.raises(ConfigError, match=r"^reward: must be one of binary, partial, got 'soft'$"):
        Verifier(answer_format="tags", reward="soft")
    with pytest.raises(ConfigError, match=r"^answer_format: "):
        Verifier(answer_format="json")

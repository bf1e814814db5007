"""pass@k estimator and standard errors against hand arithmetic."""

import math

import pytest

from rlhflab.eval.accuracy import mean_and_stderr, pass_at_k


def test_pass_at_k_hand_values():
    # n=4 samples, c=1 correct, k=1: 1 - C(3,1)/C(4,1) = 1 - 3/4 = 0.25 (= c/n)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25, abs=1e-12)
    # k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5, abs=1e-12)
    # c=0 -> 0; n-c < k -> 1
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 1, 8) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_mean_and_stderr_binary():
    # 2 of 4 correct: mean .5, sample var = 4 * .25 / 3 = 1/3, stderr = sqrt(1/3 / 4)
    mean, se = mean_and_stderr([1, 0, 1, 0])
    assert mean == 0.5
    assert se == pytest.approx(math.sqrt(1 / 12), abs=1e-12)


def test_a_prompt_longer_than_the_context_is_one_data_error(tiny_model, tiny_tokenizer):
    from rlhflab.data.tasks import Problem
    from rlhflab.errors import DataError
    from rlhflab.eval.accuracy import evaluate
    from rlhflab.rewards import Verifier

    short = Problem(question="1 + 2 =", answer="3", entry={}, task="chain_sum")
    long = Problem(question="1 + 2 " * 100, answer="3", entry={}, task="chain_sum")  # > 128
    verifier = Verifier(answer_format="plain", reward="binary")
    with pytest.raises(DataError, match=r"held-out problem 1: its prompt has \d+ tokens, which "
                       r"with max_new_tokens 8 exceeds the model's context length 128"):  # fmt: skip
        evaluate(tiny_model, tiny_tokenizer, [short, long], verifier, max_new_tokens=8)

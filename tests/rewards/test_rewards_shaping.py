"""Reward components: DAPO's soft overlong punishment by hand, and the weighted sum."""

import pytest
import torch

from rlhflab.config import RewardComponentConfig
from rlhflab.rewards.shaping import score_components, soft_overlong_penalty
from rlhflab.rewards.verifier import Verifier


def test_soft_overlong_penalty_by_hand():
    # L_max 20, L_cache 4: 0 up to 16, then (16 − |y|)/4, −1 at 20 and beyond
    lengths = torch.tensor([5, 16, 17, 18, 20, 25])
    want = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    torch.testing.assert_close(soft_overlong_penalty(lengths, max_len=20, cache=4), want)
    with pytest.raises(ValueError, match="cache"):
        soft_overlong_penalty(lengths, max_len=4, cache=5)


class _Problem:
    def __init__(self, answer):
        self.answer = answer

    def score(self, text):
        return 1.0 if text == self.answer else 0.0


def test_components_are_summed_with_weights_and_returned_unweighted():
    comps = [
        RewardComponentConfig(name="correctness"),
        RewardComponentConfig(name="length", weight=0.5),
        RewardComponentConfig(name="overlong", args={"cache": 2}),
    ]
    supplied = {
        "texts": ["12", "13", " "],
        "problems": [_Problem("12"), _Problem("12"), _Problem("12")],
        "verifier": Verifier(answer_format="plain", reward="binary"),
        "lengths": torch.tensor([2.0, 4.0, 1.0]),
        "truncated": torch.tensor([False, True, False]),
        "max_new_tokens": 4,
    }
    total, parts = score_components(comps, supplied)
    torch.testing.assert_close(parts["correctness"], torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(parts["length"], torch.tensor([-0.5, -1.0, -0.25]))
    torch.testing.assert_close(parts["overlong"], torch.tensor([0.0, -1.0, 0.0]))
    torch.testing.assert_close(total, torch.tensor([0.75, -1.5, -0.125]))


def _nan_length(*, lengths, max_new_tokens):
    """A log-only probe that fails on row 1 (e.g. a judge that could not parse its answer)."""
    return torch.tensor([0.5, float("nan"), -0.25])


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_weight_zero_component_never_enters_the_total_and_nan_is_named(monkeypatch, weight):
    from rlhflab.errors import NonFiniteError
    from rlhflab.rewards import shaping

    monkeypatch.setitem(shaping.REWARD_COMPONENTS, "length", _nan_length)
    comps = [RewardComponentConfig(name="correctness"), RewardComponentConfig(name="length",
             weight=weight)]  # fmt: skip
    supplied = {
        "texts": ["12", "13", "12"],
        "problems": [_Problem("12")] * 3,
        "verifier": Verifier(answer_format="plain", reward="binary"),
        "lengths": torch.tensor([2.0, 4.0, 1.0]),
        "max_new_tokens": 4,
    }
    if weight:
        with pytest.raises(
            NonFiniteError, match=r"reward component 'length' returned nan for row 1"
        ):
            score_components(comps, supplied)
        return
    total, parts = score_components(comps, supplied)
    torch.testing.assert_close(total, torch.tensor([1.0, 0.0, 1.0]))  # 0 · NaN kept out
    assert torch.isnan(parts["length"][1])  # still logged unweighted

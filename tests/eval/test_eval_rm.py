"""RM metrics by hand; best-of-N selection; rejection-sampling JSONL; the RewardModelScorer."""

import json

import pytest
import torch

from rlhflab.data.reward_data import ScoredSamples
from rlhflab.eval.best_of_n import selection_curve, write_rejection_sft
from rlhflab.eval.rm_metrics import auc, ece, outcome_metrics, preference_metrics, prm_metrics


def test_auc_by_hand():
    # positives {0.9, 0.4}, negatives {0.5, 0.1}: pairs (0.9>0.5, 0.9>0.1, 0.4<0.5, 0.4>0.1) → 3/4
    assert auc([0.9, 0.4, 0.5, 0.1], [1, 1, 0, 0]) == 0.75
    assert auc([0.5, 0.5], [1, 0]) == 0.5  # a tie counts one half
    assert auc([0.1, 0.2], [1, 1]) != auc([0.1, 0.2], [1, 1])  # NaN with one class


def test_ece_by_hand():
    # bin [0.8, 0.9): probs 0.8, 0.8 with labels 1, 0 → |0.5 − 0.8| = 0.3, weight 2/3
    # bin [0.2, 0.3): prob 0.2 label 0 → |0 − 0.2| = 0.2, weight 1/3  → ECE = 0.2 + 0.0667
    assert ece([0.8, 0.8, 0.2], [1, 0, 0]) == pytest.approx(0.3 * 2 / 3 + 0.2 / 3)
    assert ece([1.0, 0.0], [1, 0]) == 0.0


def test_preference_and_outcome_metrics():
    m = preference_metrics([1.0, 0.0, 2.0], [0.0, 1.0, 0.5])
    assert m["accuracy"] == pytest.approx(2 / 3)
    assert m["margin"] == pytest.approx((1 - 1 + 1.5) / 3)
    assert m["chosen_mean"] == 1.0 and m["rejected_mean"] == 0.5
    o = outcome_metrics([0.9, 0.2, 0.6], [1, 0, 0])
    assert o["accuracy"] == pytest.approx(2 / 3) and o["auc"] == 1.0


def test_prm_metrics_first_error_detection():
    probs = [[0.9, 0.2, 0.1], [0.9, 0.8], [0.9, 0.9, 0.3]]
    truth = [[True, False, False], [True, True], [True, False, False]]
    m = prm_metrics(probs, truth)
    assert m["step_accuracy"] == pytest.approx(7 / 8)  # one miss: sample 3 step 2
    assert m["first_error_acc"] == 0.5  # sample 1 right (step 1), sample 3 predicted step 2
    assert m["clean_acc"] == 1.0


def test_selection_curve_picks_the_highest_score():
    scores = [[0.1, 0.9, 0.5, 0.2]]
    correct = [[0.0, 1.0, 0.0, 0.0]]
    curve = selection_curve(scores, correct, [1, 4], n_resamples=200, seed=0)
    assert curve[4]["accuracy"] == 1.0 and curve[4]["oracle"] == 1.0
    assert curve[4]["random"] == pytest.approx(0.25)
    assert curve[1]["accuracy"] == pytest.approx(0.25, abs=0.1)  # N=1 is a random pick


def test_rejection_sampling_writes_sft_jsonl(tmp_path, tiny_tokenizer):
    from rlhflab.data.sft import load_sft_jsonl
    from rlhflab.data.tasks import make_splits

    problems = make_splits("chain_sum", n_train=2, n_heldout=1).train
    ss = ScoredSamples(
        problems,
        [[1], [1]],
        [[[2], [3]], [[2], [3]]],
        [["a", "b"], ["c", "d"]],
        [[0.0, 1.0], [1.0, 0.0]],
    )
    n = write_rejection_sft(tmp_path / "rs.jsonl", ss, [[0.2, 0.7], [0.9, 0.1]], min_score=0.8)
    rows = [json.loads(x) for x in (tmp_path / "rs.jsonl").read_text().splitlines()]
    assert n == 1 and rows[0]["completion"] == "c" and rows[0]["prompt"] == problems[1].question
    examples, _ = load_sft_jsonl(tmp_path / "rs.jsonl", tiny_tokenizer)
    assert examples[0].completion == "c"


def test_scorer_matches_model_and_normalises(tiny_model, tiny_tokenizer):
    from rlhflab.data.prm import separator_id
    from rlhflab.losses.reward_model import prm_step_correct_prob
    from rlhflab.models.reward import reward_model_from_causal_lm, token_logits
    from rlhflab.rewards.reward_model import RewardModelScorer

    rm = reward_model_from_causal_lm(tiny_model, num_labels=1)
    prompts, comps = [[5, 6, 7], [8, 9]], [[10, 11, 1], [12, 1]]
    raw = RewardModelScorer(rm, kind="preference", pad_token_id=0, micro_batch_size=1).score(
        prompts, comps
    )
    alone = [
        token_logits(rm, torch.tensor([p + c]), torch.ones(1, len(p + c), dtype=torch.long))[
            0, -1, 0
        ]
        for p, c in zip(prompts, comps, strict=False)
    ]
    torch.testing.assert_close(raw, torch.stack(alone), atol=1e-5, rtol=0)
    batch = RewardModelScorer(rm, kind="orm", pad_token_id=0, normalize="batch").score(
        prompts, comps
    )
    assert batch.mean().abs() < 1e-6 and batch.std().item() == pytest.approx(1.0, abs=1e-5)

    # PRM: min over the separator positions of P(correct)
    sep = separator_id(tiny_tokenizer)
    prm = reward_model_from_causal_lm(tiny_model, num_labels=2)
    comp = [10, sep, 11, sep, 12, 1]
    s = RewardModelScorer(prm, kind="prm", pad_token_id=0, sep_id=sep).score([[5, 6]], [comp])
    probs = prm_step_correct_prob(
        token_logits(prm, torch.tensor([[5, 6, *comp]]), torch.ones(1, 8, dtype=torch.long))
    )
    assert s.item() == pytest.approx(min(probs[0, 3].item(), probs[0, 5].item()), abs=1e-6)

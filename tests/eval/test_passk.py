"""pass@k and maj@k (rlhflab.eval.passk) against hand computations, and through `evaluate`."""

import math

import pytest

from rlhflab.eval.passk import maj_at_k, majority_vote_score, pass_at_k


def test_pass_at_k_is_chen_et_al_eq1():
    # 1 − C(n−c, k)/C(n, k) by hand: n=5, c=2, k=2: 1 − C(3,2)/C(5,2) = 1 − 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-12)
    # n=10, c=3, k=4: 1 − C(7,4)/C(10,4) = 1 − 35/210 = 5/6
    assert pass_at_k(10, 3, 4) == pytest.approx(5 / 6, abs=1e-12)
    for n, c, k in [(200, 7, 100), (64, 1, 1), (64, 63, 2), (16, 0, 8)]:
        exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    assert pass_at_k(4, 3, 2) == 1.0  # n − c < k: every k-subset holds a correct sample
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(4, 5, 2)


def test_maj_at_k_on_a_constructed_case():
    # 8 samples, k = 4: blocks [a a b None] and [b b c c]
    answers = ["a", "a", "b", None, "b", "b", "c", "c"]
    scores = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    # block 1: "a" has 2 votes, correct -> 1; block 2: b and c tie 2-2, mean of (0, 1) -> 0.5
    assert maj_at_k(answers, scores, 4) == pytest.approx((1.0 + 0.5) / 2, abs=1e-12)
    # k = 8: b has 3 votes, a 2, c 2: b wrong -> 0
    assert maj_at_k(answers, scores, 8) == 0.0
    # k = 1: each sample alone; None scores 0: (1+1+0+0+0+0+1+1)/8
    assert maj_at_k(answers, scores, 1) == pytest.approx(0.5, abs=1e-12)
    assert majority_vote_score([None, None], [1.0, 1.0]) == 0.0  # nobody voted
    # the tie rule does not depend on the order of the samples
    assert majority_vote_score(["c", "c", "b", "b"], [1, 1, 0, 0]) == 0.5
    with pytest.raises(ValueError, match="0 < k <= n"):
        maj_at_k(answers, scores, 9)


class _Recording:
    """A scorer over any text: correct when the text has an even length; the vote is the
    text's first character (stripped by `evaluate`: a blank one is no vote). Records every sampled batch it scores."""

    def __init__(self):
        self.batches = []

    def score_batch(self, texts, rows):
        self.batches.append(list(texts))
        return [float(len(t) % 2 == 0) for t in texts]

    def extract(self, text):
        return text[:1] or None


def test_evaluate_pass_and_maj_at_k_equal_hand_estimates(tiny_model, tiny_tokenizer):
    from rlhflab.data.tasks import Problem
    from rlhflab.eval.accuracy import evaluate, mean_and_stderr

    problems = [
        Problem(question=f"{i} + {i} =", answer=str(2 * i), entry={}, task="t") for i in range(5)
    ]
    scorer, n = _Recording(), 6
    res = evaluate(tiny_model, tiny_tokenizer, problems, scorer, k=[1, 2, 4], n_samples=n,
                   max_new_tokens=6, batch_size=64, return_scores=True)  # fmt: skip
    sampled = [t for batch in scorer.batches[1:] for t in batch]  # batch 0: greedy
    assert len(sampled) == 5 * n
    per_pass = {2: [], 4: []}
    per_maj = {1: [], 2: [], 4: []}
    for i in range(5):
        texts = sampled[i * n : (i + 1) * n]
        ok = [len(t) % 2 == 0 for t in texts]
        c = sum(ok)
        for k in (2, 4):
            per_pass[k].append(1 - math.comb(n - c, k) / math.comb(n, k))
        for k in (1, 2, 4):  # disjoint blocks of k; majority by first character, ties averaged
            blocks = []
            for s in range(0, n - k + 1, k):
                votes = {}
                for t, good in zip(texts[s : s + k], ok[s : s + k], strict=True):
                    vote = t[:1].strip()  # evaluate strips votes; an empty one is no vote
                    if vote:
                        votes.setdefault(vote, []).append(good)
                if not votes:
                    blocks.append(0.0)
                    continue
                top = max(len(v) for v in votes.values())
                tied = [sum(v) / len(v) for v in votes.values() if len(v) == top]
                blocks.append(sum(tied) / len(tied))
            per_maj[k].append(sum(blocks) / len(blocks))
    for k in (2, 4):
        mean, se = mean_and_stderr(per_pass[k])
        assert res[f"pass@{k}"] == pytest.approx(mean, abs=1e-12)
        assert res[f"pass@{k}_stderr"] == pytest.approx(se, abs=1e-12)
    for k in (1, 2, 4):
        assert res[f"maj@{k}"] == pytest.approx(mean_and_stderr(per_maj[k])[0], abs=1e-12)
    pass1 = [sum(len(t) % 2 == 0 for t in sampled[i * n : (i + 1) * n]) / n for i in range(5)]
    assert res["pass@1"] == pytest.approx(sum(pass1) / 5, abs=1e-12)
    assert res["n_samples"] == n and "pass@k" not in res  # the old single-k keys: int k only
    assert res["headline_name"] == "correctness (task verifier)"
    with pytest.raises(ValueError, match="below the largest k"):
        evaluate(tiny_model, tiny_tokenizer, problems, scorer, k=[8], n_samples=4)


def test_eval_config_k_list_and_n_samples():
    from rlhflab.config import EvalConfig

    assert EvalConfig(k=[1, 4], n_samples=8).k == [1, 4]
    assert EvalConfig(k=3).k == 3
    with pytest.raises(ValueError, match="below the largest k"):
        EvalConfig(k=[1, 16], n_samples=8)
    with pytest.raises(ValueError, match="ks >= 1"):
        EvalConfig(k=[0, 2])

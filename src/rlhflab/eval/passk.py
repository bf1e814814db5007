"""Sampling metrics from n samples per problem: unbiased pass@k and maj@k (pure Python).

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", arXiv 2107.03374,
eq. 1): with n >= k samples of a problem of which c are correct, the probability that at least
one of k samples drawn without replacement is correct,

    pass@k = 1 − C(n − c, k) / C(n, k) = 1 − Π_{i = n−c+1}^{n} (1 − k / i),

computed as the product (the paper's numerically stable form; the binomials overflow floats for
large n). Averaged over problems, it is an unbiased estimate of the pass@k of the model.

maj@k (self-consistency, Wang et al. 2022, "Self-Consistency Improves Chain of Thought Reasoning
in Language Models", arXiv 2203.11171): k samples vote with their extracted final answers, and
the problem counts as solved when the most frequent answer is correct. From n samples the n
samples are cut into ⌊n / k⌋ disjoint consecutive blocks of k (each an independent draw of k
samples), maj@k is computed on each block and averaged, which is unbiased for maj@k. Within a
block: samples without an extracted answer (None) do not vote; a block where none votes scores
0; when several answers tie for the most votes, the block scores the mean correctness of the
tied answers (the expected score of breaking the tie uniformly at random — deterministic, and
independent of the samples' order); the correctness of an answer is the mean score of the
block's samples that gave it (they are equal for a verifier that scores the answer alone).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 − C(n − c, k) / C(n, k) for c correct among n samples.

    Computed as 1 − Π_{i=n−c+1}^{n} (1 − k/i) in float64 (Chen et al. 2021, arXiv 2107.03374,
    eq. 1 and its numpy code). Returns a float in [0, 1]: 0 when c = 0, 1 when n − c < k.
    Raises ValueError unless 0 < k <= n and 0 <= c <= n.
    """
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 < k <= n and 0 <= c <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def majority_vote_score(answers: Sequence[Hashable | None], scores: Sequence[float]) -> float:
    """The score of a majority vote over one block of samples (see the module doc).

    Args:
        answers: each sample's extracted answer (any hashable, e.g. a normalised string), None
            when nothing could be extracted (no vote).
        scores: each sample's correctness in [0, 1] (same length).
    Returns:
        The mean correctness of the answers tied for the most votes; 0.0 when no sample voted.
    Raises:
        ValueError: answers and scores differ in length.
    """
    if len(answers) != len(scores):
        raise ValueError(f"{len(answers)} answers but {len(scores)} scores")
    votes: dict = {}
    for a, s in zip(answers, scores, strict=True):
        if a is None:
            continue
        count, total = votes.get(a, (0, 0.0))
        votes[a] = (count + 1, total + float(s))
    if not votes:
        return 0.0
    top = max(count for count, _ in votes.values())
    tied = [total / count for count, total in votes.values() if count == top]
    return sum(tied) / len(tied)


def maj_at_k(answers: Sequence[Hashable | None], scores: Sequence[float], k: int) -> float:
    """maj@k of one problem from its n samples: the mean `majority_vote_score` over the
    ⌊n / k⌋ disjoint consecutive blocks of k samples (Wang et al. 2022, arXiv 2203.11171).

    Raises ValueError unless 0 < k <= n = len(answers) (and the lengths agree).
    """
    n = len(answers)
    if not 0 < k <= n:
        raise ValueError(f"maj_at_k needs 0 < k <= n (got n={n}, k={k})")
    if len(scores) != n:
        raise ValueError(f"{n} answers but {len(scores)} scores")
    blocks = [
        majority_vote_score(answers[s : s + k], scores[s : s + k]) for s in range(0, n - k + 1, k)
    ]
    return sum(blocks) / len(blocks)

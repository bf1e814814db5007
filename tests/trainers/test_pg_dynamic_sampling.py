"""DAPO dynamic sampling: a full batch of groups with reward variance, or a clear error."""

import pytest
import torch

from rlhflab.errors import DataError
from rlhflab.rollout.dynamic import ScoredBatch, concat_rollouts, dynamic_sample, varied_groups
from rlhflab.rollout.sampler import pack

G = 3


def fake_draw(rewards_of_prompt):
    """draw(prompt ids) -> G completions per prompt; prompt p's completions have rewards
    rewards_of_prompt[p] and completion tokens of length 1 + p % 3 (ragged widths)."""
    calls = []

    def draw(chosen):
        calls.append(list(chosen))
        prompts = [[5 + p % 4] * (1 + p % 2) for p in chosen for _ in range(G)]
        comps = [[7] * (1 + p % 3) for p in chosen for _ in range(G)]
        rollout = pack(prompts, comps, pad_token_id=0)
        rewards = torch.tensor([r for p in chosen for r in rewards_of_prompt[p]])
        return ScoredBatch(
            rollout,
            rewards,
            {"correctness": rewards.clone()},
            [f"p{p}" for p in chosen for _ in range(G)],
            [p for p in chosen for _ in range(G)],
        )

    return draw, calls


def test_fills_the_batch_with_varied_groups_only():
    # prompts 0..11; every third prompt has a varied group
    table = {p: [1.0, 0.0, 0.0] if p % 3 == 0 else [1.0, 1.0, 1.0] for p in range(12)}
    draw, calls = fake_draw(table)
    batch, stats = dynamic_sample(iter(range(12)), draw, n_groups=3, group_size=G, pad_token_id=0)
    assert [c for c in calls] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert batch.problems == [0, 0, 0, 3, 3, 3, 6, 6, 6]  # group-contiguous, in draw order
    assert varied_groups(batch.rewards, G).all() and batch.rewards.numel() == 9
    assert stats == {"rounds": 3, "prompts_drawn": 9, "zero_std_group_frac": 6 / 9}
    assert batch.rollout.mask.shape[0] == 9 and torch.equal(
        batch.components["correctness"], batch.rewards
    )


def test_extra_varied_groups_are_dropped():
    table = {p: [0.0, 1.0, 1.0] for p in range(6)}
    draw, _ = fake_draw(table)
    batch, stats = dynamic_sample(iter(range(6)), draw, n_groups=2, group_size=G, pad_token_id=0)
    assert batch.problems == [0, 0, 0, 1, 1, 1] and stats["rounds"] == 1


def test_exhausted_prompt_source_is_a_clear_error():
    table = {p: [1.0, 1.0, 1.0] if p != 4 else [0.0, 1.0, 0.0] for p in range(6)}
    draw, _ = fake_draw(table)
    with pytest.raises(
        DataError, match=r"prompt source is exhausted after 6 prompts in 2 rounds.*1/3"
    ):
        dynamic_sample(iter(range(6)), draw, n_groups=3, group_size=G, pad_token_id=0)


def test_concat_rollouts_keeps_tokens_and_masks():
    a = pack([[1, 2]], [[3]], pad_token_id=0)
    b = pack([[4]], [[5, 6, 7]], pad_token_id=0)
    c = concat_rollouts([a, b], pad_token_id=0)
    assert c.prompt_ids.tolist() == [[1, 2], [0, 4]] and c.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert c.completion_ids.tolist() == [[3, 0, 0], [5, 6, 7]]
    assert c.mask.tolist() == [[1, 0, 0], [1, 1, 1]]

"""Dense (process) credit: `token_rewards` and `process_group_zscore` (DeepSeekMath §4.1.3)
against hand arithmetic and a naive loop over groups, steps and tokens written from the paper:

    R = all step rewards of the G outputs of a prompt;  r̃ = (r − mean(R)) / std(R)
    Â_{i,t} = Σ_{index(j) ≥ t} r̃_i^{index(j)}
"""

import math

import pytest
import torch

from rlhflab.losses import advantages as A

F64 = torch.float64


def naive_process_adv(rewards, mask, steps, group_size, *, eps=1e-6, unbiased=True):
    """The paper's definition, one group, one step, one token at a time (float64 lists)."""
    b, t = len(rewards), len(rewards[0])
    adv = [[0.0] * t for _ in range(b)]
    for g0 in range(0, b, group_size):
        rows = range(g0, g0 + group_size)
        pool = [rewards[i][s] for i in rows for s in range(t) if steps[i][s]]
        if len(pool) < 2 or all(x == pool[0] for x in pool):
            continue  # no signal: 0 everywhere in the group
        mean = sum(pool) / len(pool)
        dof = len(pool) - 1 if unbiased else len(pool)
        std = math.sqrt(sum((x - mean) ** 2 for x in pool) / dof)
        for i in rows:
            for tok in range(t):
                if not mask[i][tok]:
                    continue
                adv[i][tok] = sum(
                    (rewards[i][s] - mean) / (std + eps) for s in range(tok, t) if steps[i][s]
                )
    return torch.tensor(adv, dtype=F64)


def random_batch(gen, n_groups, group_size, t, *, p_step=0.3):
    b = n_groups * group_size
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    steps = (torch.rand(b, t, generator=gen) < p_step) & mask
    steps[0] = False  # a completion without any step separator
    rewards = torch.where(steps, torch.rand(b, t, generator=gen, dtype=F64), 0.0)
    return rewards, mask, steps


@pytest.mark.parametrize("unbiased", [True, False])
def test_process_group_zscore_matches_naive_loop(unbiased):
    gen = torch.Generator().manual_seed(0)
    rewards, mask, steps = random_batch(gen, n_groups=4, group_size=3, t=9)
    got = A.process_group_zscore(rewards, mask, group_size=3, steps=steps, unbiased=unbiased)
    want = naive_process_adv(rewards.tolist(), mask.tolist(), steps.tolist(), 3, unbiased=unbiased)
    assert got.dtype == F64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert got.abs().sum() > 0  # the comparison is not 0 == 0


def test_process_group_zscore_by_hand():
    # G = 2, T = 4. Output 0: steps end at t=0 (r=1) and t=2 (r=0); output 1: at t=1 (r=0) and
    # t=3 (r=1). R = {1, 0, 0, 1}: mean 1/2, unbiased std = sqrt(4·(1/4)/3) = 1/√3, so
    # r̃ = ±(1/2)·√3 = ±√3/2 (eps = 0). Â_{0,t}: t=0: √3/2 − √3/2 = 0; t=1, 2: −√3/2; t=3: 0.
    # Â_{1,t}: t=0, 1: −√3/2 + √3/2 = 0; t=2, 3: +√3/2.
    h = math.sqrt(3) / 2
    rewards = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 1.0]], dtype=F64)
    steps = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    adv = A.process_group_zscore(rewards, torch.ones(2, 4), group_size=2, steps=steps, eps=0.0)
    want = torch.tensor([[0.0, -h, -h, 0.0], [0.0, 0.0, h, h]], dtype=F64)
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-12)


def test_edge_cases_one_step_no_separator_all_equal():
    mask = torch.ones(4, 3, dtype=torch.bool)
    # all-equal step rewards in a group: exactly 0, never rounding noise or 0/0
    steps = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 1], [0, 0, 1]], dtype=torch.bool)
    rewards = torch.where(steps, 0.1, 0.0).to(F64)
    adv = A.process_group_zscore(rewards, mask, group_size=2, steps=steps)
    assert torch.equal(adv, torch.zeros(4, 3, dtype=F64))
    # one step in the whole group (std undefined): 0
    one = torch.zeros(2, 3, dtype=torch.bool)
    one[0, 1] = True
    adv = A.process_group_zscore(torch.where(one, 0.7, 0.0).to(F64), mask[:2], group_size=2,
                                 steps=one)  # fmt: skip
    assert torch.equal(adv, torch.zeros(2, 3, dtype=F64))
    # no separator anywhere: 0, and a step-less completion adds nothing to the pool
    none = torch.zeros(2, 3, dtype=torch.bool)
    assert torch.equal(
        A.process_group_zscore(torch.zeros(2, 3, dtype=F64), mask[:2], group_size=2, steps=none),
        torch.zeros(2, 3, dtype=F64),
    )
    # one step per output: GRPO's outcome z-score on every token up to the step, 0 after it
    last = torch.tensor([[0, 1, 0], [0, 0, 1], [1, 0, 0], [0, 1, 0]], dtype=torch.bool)
    r = torch.tensor([0.9, 0.2, 0.4, 0.3], dtype=F64)
    adv = A.process_group_zscore(torch.where(last, r[:, None], 0.0), mask, group_size=2,
                                 steps=last)  # fmt: skip
    z = A.group_zscore(r, group_size=2)
    upto = last.flip(-1).cumsum(-1).flip(-1).bool()  # tokens at or before the step
    torch.testing.assert_close(adv, torch.where(upto, z[:, None], 0.0), rtol=0, atol=1e-12)


def test_stepless_completion_does_not_move_the_pool():
    gen = torch.Generator().manual_seed(1)
    rewards, mask, steps = random_batch(gen, n_groups=1, group_size=3, t=6, p_step=0.6)
    rewards[1], steps[1] = 0.0, False  # output 1 has no step: adv 0 there
    adv = A.process_group_zscore(rewards, mask, group_size=3, steps=steps)
    assert torch.equal(adv[1], torch.zeros(6, dtype=F64))
    # same pool with the step-less output replaced by another step-less one of any length
    mask2 = mask.clone()
    mask2[1] = torch.arange(6) < 2
    torch.testing.assert_close(
        A.process_group_zscore(rewards, mask2, group_size=3, steps=steps)[[0, 2]], adv[[0, 2]]
    )


def test_outcome_only_equals_group_zscore_broadcast():
    """No dense reward: the outcome at the last token is one position per output, and process
    GRPO is outcome GRPO (§4.1.2) on every token of the completion."""
    r = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.25, 1.0], dtype=F64)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 3, 1, 4, 2, 5])[:, None]
    tok, given = A.token_rewards(None, None, r, mask, outcome=True)
    adv = A.process_group_zscore(tok, mask, group_size=3, steps=given)
    want = torch.where(mask, A.group_zscore(r, group_size=3)[:, None], 0.0)
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-12)


def test_token_rewards_places_steps_and_outcome():
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    steps = torch.tensor([[0, 1, 0, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    step_r = torch.tensor([[0, 0.5, 0, 0.25, 0], [0.75, 0, 0, 0, 0]], dtype=F64)
    outcome = torch.tensor([1.0, -1.0], dtype=F64)
    tok, given = A.token_rewards(step_r, steps, outcome, mask, outcome=True)
    # row 0: its last valid token (t=3) ends a step: 0.25 + 1 share the position
    assert tok.tolist() == [[0, 0.5, 0, 1.25, 0], [0.75, 0, 0, 0, -1.0]]
    assert given.tolist() == [[0, 1, 0, 1, 0], [1, 0, 0, 0, 1]]
    tok, given = A.token_rewards(step_r, steps, torch.zeros(2, dtype=F64), mask, outcome=False)
    assert torch.equal(given, steps) and torch.equal(tok, step_r)
    with pytest.raises(ValueError, match="outside mask"):
        A.token_rewards(step_r, steps | ~mask, outcome, mask, outcome=True)
    with pytest.raises(ValueError, match="both"):
        A.token_rewards(step_r, None, outcome, mask, outcome=True)
    with pytest.raises(ValueError, match="mask's shape"):
        A.token_rewards(step_r[:, :3], steps[:, :3], outcome, mask, outcome=True)


def test_dense_rewards_enter_gae_at_their_positions():
    """PPO with a critic: the same per-token rewards go to `gae`; with γ = λ = 1 and V = 0 the
    advantage is the sum of the rewards at or after t."""
    mask = torch.ones(1, 4, dtype=torch.bool)
    steps = torch.tensor([[1, 0, 1, 0]], dtype=torch.bool)
    step_r = torch.tensor([[0.5, 0, 0.25, 0]], dtype=F64)
    tok, _ = A.token_rewards(step_r, steps, torch.tensor([1.0], dtype=F64), mask, outcome=True)
    adv, _ = A.gae(tok, torch.zeros_like(tok), mask, gamma=1.0, lam=1.0)
    assert adv.tolist() == [[1.75, 1.25, 1.25, 1.0]]


def test_process_group_zscore_errors():
    mask = torch.ones(4, 3, dtype=torch.bool)
    r = torch.zeros(4, 3, dtype=F64)
    with pytest.raises(ValueError, match="group_size"):
        A.process_group_zscore(r, mask, group_size=1, steps=mask)
    with pytest.raises(ValueError, match="divisible"):
        A.process_group_zscore(r, mask, group_size=3, steps=mask)
    with pytest.raises(ValueError, match="one \\(B, T\\) shape"):
        A.process_group_zscore(r[:, 0], mask, group_size=2, steps=mask)
    with pytest.raises(ValueError, match="outside mask"):
        A.process_group_zscore(r, mask & False, group_size=2, steps=mask)
    with pytest.raises(ValueError, match="eps"):
        A.process_group_zscore(r, mask, group_size=2, steps=mask, eps=-1.0)

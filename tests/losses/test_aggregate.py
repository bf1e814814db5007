"""Loss aggregation: hand values per mode; k micro-batches == one batch (value and gradient)."""

import pytest
import torch

from rlhflab.losses import aggregate as agg
from rlhflab.losses.policy import ppo_clip

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])  # lengths 3 and 1; masked sum = 1 + 2 + 3 + 4 = 10


@pytest.mark.parametrize(
    ("mode", "kwargs", "want"),
    [
        ("token_mean", {"num_tokens": 4}, 10 / 4),  # 2.5
        ("seq_mean_token_mean", {"num_seqs": 2}, (6 / 3 + 4 / 1) / 2),  # (2 + 4)/2 = 3
        ("seq_mean_token_sum", {"num_seqs": 2}, 10 / 2),  # 5
        ("seq_mean_token_sum_norm", {"num_seqs": 2, "max_len": 3}, 10 / (2 * 3)),  # 1.6667
    ],
)
def test_modes_by_hand(mode, kwargs, want):
    got = agg.aggregate(LOSS, MASK, mode, **kwargs)
    assert got.ndim == 0 and got.item() == pytest.approx(want, abs=1e-12)
    assert agg.AGGREGATIONS[mode](LOSS, MASK, **kwargs).item() == got.item()


def test_empty_row_contributes_zero_in_seq_mean_token_mean():
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    assert agg.aggregate(LOSS, mask, "seq_mean_token_mean", num_seqs=2).item() == 1.0  # (6/3 + 0)/2


def test_denominators_as_tensors_and_extra_denominators_ignored():
    got = agg.aggregate(
        LOSS, MASK, "token_mean", num_tokens=torch.tensor(4.0), num_seqs=None, max_len=7
    )
    assert got.item() == 2.5


def test_errors_name_the_missing_denominator():
    with pytest.raises(ValueError, match="num_tokens"):
        agg.aggregate(LOSS, MASK, "token_mean", num_seqs=2)
    with pytest.raises(ValueError, match="max_len"):
        agg.aggregate(LOSS, MASK, "seq_mean_token_sum_norm", num_seqs=2)
    with pytest.raises(ValueError, match="num_seqs"):
        agg.aggregate(LOSS, MASK, "seq_mean_token_mean", num_seqs=0)
    with pytest.raises(ValueError, match="token_mean, seq_mean_token_mean"):
        agg.aggregate(LOSS, MASK, "mean", num_tokens=4)
    with pytest.raises(ValueError, match="mask"):
        agg.aggregate(LOSS, MASK[:, :2], "token_mean", num_tokens=4)


def _step_loss(weights, rows, mask, logp_old, adv, mode, denominators):
    logp = torch.nn.functional.logsigmoid(
        weights[rows]
    )  # recomputed per micro-batch, like a forward
    loss, _ = ppo_clip(logp, logp_old[rows], adv[rows], mask[rows], eps_low=0.2, eps_high=0.28)
    return agg.aggregate(loss, mask[rows], mode, **denominators)


@pytest.mark.parametrize("mode", list(agg.AGGREGATIONS))
def test_micro_batches_equal_one_batch_value_and_gradient(mode):
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([6, 2, 4, 1, 5, 3, 6])  # uneven completion lengths
    b, t_max = len(lengths), 6
    mask = torch.arange(t_max)[None, :] < lengths[:, None]
    weights = torch.randn(b, t_max, generator=g, requires_grad=True)
    logp_old = torch.nn.functional.logsigmoid(
        weights.detach() + 0.3 * torch.randn(b, t_max, generator=g)
    )
    adv = torch.randn(b, generator=g)
    # counted once for the whole optimizer step
    denominators = {"num_tokens": int(mask.sum()), "num_seqs": b, "max_len": t_max}

    full = _step_loss(weights, slice(0, b), mask, logp_old, adv, mode, denominators)
    (grad_full,) = torch.autograd.grad(full, weights)

    total = torch.zeros(())
    splits = [slice(0, 1), slice(1, 4), slice(4, 7)]  # uneven micro-batches: 1, 3, 3 rows
    for rows in splits:
        part = _step_loss(weights, rows, mask, logp_old, adv, mode, denominators)
        part.backward()  # gradients accumulate in weights.grad, as in gradient accumulation
        total = total + part.detach()
    torch.testing.assert_close(total, full.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(weights.grad, grad_full, rtol=0, atol=1e-6)
    assert grad_full.abs().sum() > 0


def test_per_micro_batch_token_count_would_be_wrong():
    # the classic bug this API prevents: dividing each micro-batch by its own token count
    loss = torch.ones(3, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0]])
    right = agg.aggregate(loss, mask, "token_mean", num_tokens=6)  # 6/6 = 1
    wrong = sum(
        agg.aggregate(loss[r], mask[r], "token_mean", num_tokens=int(mask[r].sum()))
        for r in (slice(0, 1), slice(1, 3))
    )
    assert right.item() == 1.0 and wrong.item() == 2.0  # 4/4 + 2/2


def test_aggregate_dispatches_through_its_tables():
    """Every mode has its denominators declared (the keyword arguments of its function), and
    aggregate() passes exactly those: the others may be None."""
    import inspect

    assert set(agg.DENOMINATORS) == set(agg.AGGREGATIONS)
    for mode, fn in agg.AGGREGATIONS.items():
        params = inspect.signature(fn).parameters
        kw = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert set(agg.DENOMINATORS[mode]) == kw, mode
    got = agg.aggregate(LOSS, MASK, "seq_mean_token_sum_norm", num_seqs=2, max_len=3)
    assert got.item() == pytest.approx(10 / 6, abs=1e-12)
    with pytest.raises(ValueError, match=r"^num_seqs is required by this aggregation"):
        agg.aggregate(LOSS, MASK, "seq_mean_token_mean", num_tokens=4)
    with pytest.raises(ValueError, match=r"unknown aggregation mode 'sum'; valid: token_mean, "):
        agg.aggregate(LOSS, MASK, "sum", num_tokens=4)


def test_aliases_name_registered_modes():
    assert set(agg.AGGREGATION_ALIASES.values()) <= set(agg.AGGREGATIONS)
    assert not set(agg.AGGREGATION_ALIASES) & set(agg.AGGREGATIONS)

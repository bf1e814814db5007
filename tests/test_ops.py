"""rlhflab.ops: masked reductions, whitening, chunked log-softmax and entropy, against definitions."""

import math

import pytest
import torch

from rlhflab import ops

F64 = torch.float64


def _assert_rounding_of(got, exact, dtype):
    """`got` equals the float64 value `exact` up to float rounding: of a float32 computation
    (16 eps32 of the largest magnitude: a few roundings of sums of ~40 terms), then of the
    result cast to `dtype` (half an ulp of dtype, here 1 eps·|exact| for margin). Comparing two
    float32 computations with each other instead (a fixed atol) depends on the CPU's kernels."""
    scale = max(exact.abs().max().item(), 1.0)
    tol = 16 * torch.finfo(torch.float32).eps * scale + torch.finfo(dtype).eps * exact.abs()
    err = (got.double() - exact).abs()
    assert (err <= tol).all(), (
        f"max error {err.max().item():.3g} (tolerance {tol.max().item():.3g})"
    )


def naive_logp(logits, index):
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays float64
    return torch.log_softmax(z, -1).gather(-1, index[..., None]).squeeze(-1)


def naive_entropy(logits):
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays float64
    return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)


# --- masked reductions ------------------------------------------------------------------------


def test_masked_sum_and_mean_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=F64)
    assert ops.masked_sum(x, mask).item() == 7.0  # 1 + 2 + 4
    assert ops.masked_mean(x, mask).item() == 7.0 / 3.0
    assert torch.equal(ops.masked_sum(x, mask, dim=-1), torch.tensor([3.0, 4.0], dtype=F64))
    assert torch.equal(ops.masked_mean(x, mask, dim=-1), torch.tensor([1.5, 4.0], dtype=F64))
    assert torch.equal(
        ops.masked_mean(x, mask.bool(), dim=0), torch.tensor([2.5, 2.0, 0.0], dtype=F64)
    )


def test_masked_mean_empty_row_is_zero_with_finite_grad():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=F64)
    out = ops.masked_mean(x, mask, dim=-1)
    assert torch.equal(out.detach(), torch.tensor([1.5, 0.0], dtype=F64))
    out.sum().backward()
    assert torch.equal(x.grad, torch.tensor([[0.5, 0.5], [0.0, 0.0]], dtype=F64))
    assert ops.masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_padding_garbage_does_not_leak():
    x = torch.tensor([1.0, float("inf"), float("nan")], requires_grad=True)
    mask = torch.tensor([True, False, False])
    out = ops.masked_mean(x, mask)
    out.backward()
    assert out.item() == 1.0
    assert torch.equal(x.grad, torch.tensor([1.0, 0.0, 0.0]))


def test_masked_var_matches_torch_var_on_valid_elements():
    x = torch.tensor([[1.0, 2.0, 4.0], [7.0, 100.0, -5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]]).bool()
    valid = x[mask]  # [1, 2, 4, 7]: mean 3.5, Σ(x−μ)² = 6.25+2.25+0.25+12.25 = 21
    assert ops.masked_var(x, mask).item() == pytest.approx(21 / 4, abs=1e-12)
    assert ops.masked_var(x, mask, unbiased=True).item() == pytest.approx(21 / 3, abs=1e-12)
    assert ops.masked_var(x, mask, unbiased=True).item() == pytest.approx(
        valid.var().item(), abs=1e-12
    )
    one = torch.tensor([[1, 0, 0], [0, 0, 0]]).bool()
    assert ops.masked_var(x, one, unbiased=True).item() == 0.0  # no spread, not NaN


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 4.0], [7.0, 100.0, -5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]]).bool()
    w = ops.masked_whiten(x, mask, eps=0.0)
    # valid [1, 2, 4, 7]: mean 3.5, population std sqrt(21/4)
    expected = (torch.tensor([1.0, 2.0, 4.0, 7.0], dtype=F64) - 3.5) / math.sqrt(21 / 4)
    torch.testing.assert_close(w[mask], expected, rtol=0, atol=1e-12)
    assert torch.equal(w[~mask], torch.zeros(2, dtype=F64))
    kept = ops.masked_whiten(x, mask, shift_mean=False, eps=0.0)
    torch.testing.assert_close(kept[mask], expected + 3.5, rtol=0, atol=1e-12)


def test_masked_shape_mismatch_raises():
    with pytest.raises(ValueError, match="mask"):
        ops.masked_mean(torch.zeros(2, 3), torch.ones(3, 2))


# --- selective_log_softmax / entropy ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_size", [1, 3, 1024])
def test_selective_log_softmax_matches_naive(dtype, chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(2, 5, 37, generator=g)).to(dtype)  # 10 rows: chunks of 1 and 3 < rows
    index = torch.randint(0, 37, (2, 5), generator=g)
    out = ops.selective_log_softmax(logits, index, chunk_size=chunk_size)
    assert out.dtype == torch.float32 and out.shape == (2, 5)
    _assert_rounding_of(out, naive_logp(logits.double(), index), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_log_softmax_gradient_matches_naive(dtype):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 4, 11, generator=g).to(dtype)
    index = torch.randint(0, 11, (3, 4), generator=g)
    w = torch.randn(3, 4, generator=g)
    a = base.clone().requires_grad_(True)
    (w * ops.selective_log_softmax(a, index, chunk_size=5)).sum().backward()
    assert a.grad.dtype == dtype
    exact = base.double().requires_grad_(True)
    (w.double() * naive_logp(exact, index)).sum().backward()
    _assert_rounding_of(a.grad, exact.grad, dtype)


def test_selective_log_softmax_gradcheck_float64():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 7, generator=g, dtype=F64, requires_grad=True)
    index = torch.randint(0, 7, (2, 3), generator=g)
    assert torch.autograd.gradcheck(
        lambda z: ops.selective_log_softmax(z, index, chunk_size=4), (logits,)
    )


def test_selective_log_softmax_errors_and_empty():
    with pytest.raises(ValueError, match="index"):
        ops.selective_log_softmax(torch.zeros(2, 3, 5), torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="index"):
        ops.selective_log_softmax(torch.zeros(2, 5), torch.zeros(2))
    with pytest.raises(ValueError, match="chunk_size"):
        ops.selective_log_softmax(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), chunk_size=0)
    assert ops.selective_log_softmax(
        torch.zeros(0, 4, 5), torch.zeros(0, 4, dtype=torch.long)
    ).shape == (0, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [2, 1024])
def test_entropy_matches_naive_value_and_gradient(dtype, chunk_size):
    g = torch.Generator().manual_seed(3)
    base = (2 * torch.randn(3, 3, 13, generator=g)).to(dtype)  # 9 rows
    w = torch.randn(3, 3, generator=g)
    a = base.clone().requires_grad_(True)
    out = ops.entropy_from_logits(a, chunk_size=chunk_size)
    assert out.dtype == torch.float32 and out.shape == (3, 3)
    exact = base.double().requires_grad_(True)
    _assert_rounding_of(out, naive_entropy(exact), torch.float32)
    (w * out).sum().backward()
    (w.double() * naive_entropy(exact)).sum().backward()
    _assert_rounding_of(a.grad, exact.grad, dtype)


def test_entropy_known_values_and_minus_inf_logits():
    # uniform over V=8 -> log 8; one token at -inf: uniform over the other 2 -> log 2, no NaN
    assert ops.entropy_from_logits(torch.zeros(8)).item() == pytest.approx(math.log(8), abs=1e-6)
    z = torch.tensor([0.0, 0.0, float("-inf")], requires_grad=True)
    h = ops.entropy_from_logits(z)
    h.backward()
    assert h.item() == pytest.approx(math.log(2), abs=1e-6)
    assert torch.isfinite(z.grad).all()


def test_entropy_gradcheck_float64():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 6, generator=g, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: ops.entropy_from_logits(z, chunk_size=3), (logits,))

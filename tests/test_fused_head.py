"""The fused LM head (`ops.linear_selective_log_softmax`) against the unchunked computation.

float64: log-probs, entropy and the gradients of the hidden states, the head's weight and bias
equal log_softmax(h·Wᵀ + b)/τ)[i] computed whole, for chunk sizes that do and do not divide the
rows. bf16 autocast: equal to the padded bf16 path (nn.Linear under autocast, its logits upcast)
within a tolerance derived from bf16's eps. `completion_logps` of a model scored through its own
forward with the fused head in place of the LM head (the FSDP2 path) equals the plain path.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from rlhflab import ops

F64 = torch.float64


def _problem(dtype, *, n_rows=(2, 5), hidden=6, vocab=23, bias=True, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    h = (scale * torch.randn(*n_rows, hidden, generator=g)).to(dtype)
    w = (scale * torch.randn(vocab, hidden, generator=g)).to(dtype)
    b = torch.randn(vocab, generator=g).to(dtype) if bias else None
    index = torch.randint(0, vocab, n_rows, generator=g)
    coef = torch.randn(*n_rows, generator=g).to(dtype)  # d loss / d logp, uneven per row
    return h, w, b, index, coef


def _leaves(*ts):
    return [t.detach().clone().requires_grad_(True) if t is not None else None for t in ts]


def _grads(*ts):
    return [t.grad for t in ts if t is not None]


def _close64(a, b):
    """Equal to float64 rounding: 1e4·eps64 of the larger magnitude of `b`."""
    assert a.dtype == b.dtype == F64
    atol = 1e4 * torch.finfo(F64).eps * max(b.abs().max().item(), 1e-30)
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 7, 10, 64, None])  # 10 rows
def test_fused_equals_unchunked_float64(chunk_size, temperature, bias):
    h0, w0, b0, index, coef = _problem(F64, bias=bias)
    h, w, b = _leaves(h0, w0, b0)
    lp, ent = ops.linear_selective_log_softmax(
        h, w, index, bias=b, temperature=temperature, chunk_size=chunk_size, with_entropy=True
    )
    assert lp.dtype == ent.dtype == F64 and lp.shape == ent.shape == index.shape
    (coef * lp + coef * lp * lp).sum().backward()  # a non-linear loss of the log-probs

    hr, wr, br = _leaves(h0, w0, b0)
    z = F.linear(hr, wr, br) / temperature  # (2, 5, V), the whole logits
    logp = torch.log_softmax(z, -1)
    lp_ref = logp.gather(-1, index[..., None]).squeeze(-1)
    ent_ref = -(logp.exp() * logp).sum(-1)
    (coef * lp_ref + coef * lp_ref * lp_ref).sum().backward()

    _close64(lp.detach(), lp_ref.detach())
    _close64(ent, ent_ref.detach())
    assert not ent.requires_grad
    for got, want in zip(_grads(h, w, b), _grads(hr, wr, br), strict=True):
        _close64(got, want)


def test_fused_gradcheck_float64():
    h, w, b, index, _ = _problem(F64, n_rows=(7,), hidden=4, vocab=9, seed=1)
    h, w, b = _leaves(h, w, b)
    assert torch.autograd.gradcheck(
        lambda h, w, b: ops.linear_selective_log_softmax(
            h, w, index, bias=b, temperature=0.8, chunk_size=3
        )[0],
        (h, w, b),
    )


@pytest.mark.parametrize("chunk_size", [3, None])
def test_fused_under_bf16_autocast_equals_the_padded_bf16_path(chunk_size):
    """fp32 hidden states and head (an fp32 model's) under CPU bf16 autocast: the fused head's
    matmuls in bf16, log-softmax in fp32, as the padded path (nn.Linear under autocast, logits
    upcast, `selective_log_softmax`). The two differ only by rounding; the bound, from bf16's
    eps e and the largest |logit| m (computed in float64):
    - logits: each path's bf16 logit is the same fp32 dot product rounded once to bf16, up to
      one ulp apart: |Δz| <= e·m, so |Δ log p| <= 2·e·m and |Δ H| <= 2·e·m (H's derivative
      in z is bounded by the same softmax weights);
    - gradients: grad_z = g·(onehot − p) moves by at most |g|·p·(exp(2·e·m) − 1) through p, and
      each path rounds grad_z and the matmul's result to bf16 (e/2 each, twice: 2·e); every
      entry of grad_h = grad_z·W and grad_W = grad_zᵀ·h is then within
      (exp(2·e·m) − 1 + 2·e) × (|grad_z|·|W|, |grad_z|ᵀ·|h|) of the other path's, |·| taken
      elementwise in float64. The bias gradient is summed in fp32 by both: the same bound.
    """
    e = torch.finfo(torch.bfloat16).eps
    h0, w0, b0, index, coef = _problem(torch.float32, n_rows=(3, 7), hidden=16, vocab=50, seed=2)

    h, w, b = _leaves(h0, w0, b0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = ops.linear_selective_log_softmax(
            h, w, index, bias=b, chunk_size=chunk_size, with_entropy=True
        )
    (coef * lp).sum().backward()

    hp, wp, bp = _leaves(h0, w0, b0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(hp, wp, bp)  # (3, 7, V) bf16: the padded path
    assert logits.dtype == torch.bfloat16
    lp_pad = ops.selective_log_softmax(logits.float(), index)
    ent_pad = ops.entropy_from_logits(logits.float().detach())
    (coef * lp_pad).sum().backward()

    z64 = F.linear(h0.double(), w0.double(), b0.double())  # magnitudes, in float64
    m = z64.abs().max().item()
    tol_lp = 2 * e * m
    assert (lp.detach().double() - lp_pad.detach().double()).abs().max() <= tol_lp
    assert (ent.double() - ent_pad.double()).abs().max() <= tol_lp
    p = torch.softmax(z64, -1)
    gz = coef.double()[..., None] * (F.one_hot(index, 50).double() - p)  # (3, 7, V)
    gz_abs = gz.abs().reshape(-1, 50) * math.exp(2 * e * m)  # grad_z's size, with its error
    k = math.exp(2 * e * m) - 1 + 2 * e
    bound_h = k * (gz_abs @ w0.double().abs()).reshape(h0.shape)
    bound_w = k * (gz_abs.T @ h0.double().reshape(-1, 16).abs())
    bound_b = k * gz_abs.sum(0)
    for got, want, bound in [(h, hp, bound_h), (w, wp, bound_w), (b, bp, bound_b)]:
        assert got.grad.dtype == torch.float32
        err = (got.grad.double() - want.grad.double()).abs()
        assert (err <= bound).all(), f"max error {err.max():.3g}, bound there {bound.max():.3g}"
    # log p is unchanged by adding one constant to every logit, so the bias gradient sums to 0
    # over the vocabulary when the backward's softmax is that of the forward's (bf16) logits: up
    # to fp32 rounding of each row's Σ_k p_k (V roundings) times |d loss / d logp| per row
    eps32 = torch.finfo(torch.float32).eps
    assert abs(b.grad.double().sum()) <= 4 * 50 * eps32 * coef.abs().sum()
    # and the fused head did compute in bf16: its log-probs are not the fp32 head's
    lp32, _ = ops.linear_selective_log_softmax(h0, w0, index, bias=b0)
    assert not torch.equal(lp.detach(), lp32)


def _plain_logps_and_grads(model, ro, temperature, monkeypatch):
    import rlhflab.rollout.sampler as sampler

    with monkeypatch.context() as m:
        m.setattr(sampler, "can_pack", lambda model: False)  # the padded path, whole logits
        return _logps_and_grads(model, ro, temperature)


def _logps_and_grads(model, ro, temperature):
    from rlhflab.rollout.sampler import completion_logps

    lp, ent = completion_logps(model, ro, temperature=temperature, with_entropy=True)
    (lp.sum() + (lp * lp).sum()).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    return lp.detach(), ent, grads


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_sharded_path_fused_in_the_models_forward_equals_the_plain_path(
    tiny_model64, monkeypatch, temperature, packed
):
    """An FSDP2-sharded model is scored through its own forward with the fused head in place of
    the LM head (`sampler._fused_in_forward`), padded or (rows of very uneven length) in the
    varlen packed layout. Taken here on one process (is_sharded patched): the same log-probs,
    entropies and gradients as the padded path with whole logits; the head's forward is the
    class's again afterwards. tests/distributed runs it under FSDP2."""
    import rlhflab.rollout.sampler as sampler
    from rlhflab.rollout.sampler import pack

    if packed:
        ro = pack([[5, 6, 7], [8, 9], [10], [12, 13, 14, 15, 16, 17]],
                  [[11, 12, 13, 14, 15, 16, 17, 18, 19], [15], [16, 17], [18]], 0)  # fmt: skip
    else:
        ro = pack([[5, 6, 7], [8, 9], [10]], [[11, 12, 13, 14], [15], [16, 17]], 0)
    lp0, e0, g0 = _plain_logps_and_grads(tiny_model64, ro, temperature, monkeypatch)
    calls = []
    real = sampler._fused_in_forward
    monkeypatch.setattr(sampler.distributed, "is_sharded", lambda model: True)
    monkeypatch.setattr(sampler, "_fused_in_forward", lambda *a: calls.append(a[3]) or real(*a))
    if not packed:
        monkeypatch.setattr(sampler, "layout_for", lambda *a, **k: None)
    lp1, e1, g1 = _logps_and_grads(tiny_model64, ro, temperature)
    assert len(calls) == 1
    assert (calls[0] is not None) == packed  # the layout: varlen (no 4-D mask) when packed
    assert calls[0] is None or calls[0].attention_mask is None
    _close64(lp1, lp0)
    _close64(e1, e0)
    assert (lp1 * (1 - ro.mask)).abs().max() == 0
    for a, b in zip(g1, g0, strict=True):
        _close64(a, b)
    assert "forward" not in vars(tiny_model64.get_output_embeddings())


def test_fused_path_is_taken_under_autocast(tiny_model, monkeypatch):
    """Under bf16 autocast (as on a GPU) a plain-head model is scored by the fused head too, not
    through (B, T, V) logits: the LM head module is never called."""
    import rlhflab.rollout.sampler as sampler
    from rlhflab.rollout.sampler import completion_logps, pack

    monkeypatch.setattr(sampler, "layout_for", lambda *a, **k: None)  # the padded fused path
    ro = pack([[5, 6, 7], [8, 9]], [[11, 12, 13], [15]], 0)
    head = tiny_model.get_output_embeddings()
    called = []
    handle = head.register_forward_hook(lambda *a: called.append(1))
    try:
        lp, _ = completion_logps(tiny_model, ro, autocast_dtype=torch.bfloat16)
    finally:
        handle.remove()
    assert called == [] and lp.dtype == torch.float32 and lp.shape == ro.mask.shape
    assert torch.isfinite(lp).all() and (lp * ro.mask <= 0).all()

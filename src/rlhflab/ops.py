"""Tensor operations shared by losses and trainers: masked reductions, whitening, log-probs, entropy.

Pure functions of tensors; they import only torch. A `mask` is 1 (or True) where a token is valid and
0 (or False) where it is padding; masks are treated as binary (any non-zero value counts as valid),
and masked-out positions never contribute a value or a gradient, even when they hold inf or NaN.
"""

import torch
from torch import Tensor

__all__ = [
    "entropy_from_logits",
    "linear_selective_log_softmax",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "position_ids_from_mask",
    "selective_log_softmax",
]


def _check_mask(x: Tensor, mask: Tensor) -> Tensor:
    if mask.shape != x.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected x's shape {tuple(x.shape)}")
    return mask.bool()


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of the valid elements of `x`: Σ x·m.

    Shapes: x (...) any float dtype; mask (...) bool or 0/1 float, same shape as x.
    Returns: a scalar when dim is None, else x reduced over `dim`; dtype of x.
    Masked-out elements are replaced by 0 before summing (not multiplied by 0), so inf/NaN padding
    cannot leak into the sum or its gradient.
    Raises: ValueError if mask's shape differs from x's.
    """
    m = _check_mask(x, mask)
    y = torch.where(m, x, 0.0)
    return y.sum() if dim is None else y.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of the valid elements of `x`: Σ x·m / Σ m.

    Shapes: x (...) any float dtype; mask (...) bool or 0/1 float, same shape as x.
    Returns: a scalar when dim is None, else x reduced over `dim`; dtype of x.
    Convention: where the mask is all zero along the reduced dims the mean is 0 (not NaN), with zero
    gradient, so an empty row (e.g. a completion of length 0) contributes nothing.
    Raises: ValueError if mask's shape differs from x's.
    """
    m = _check_mask(x, mask)
    total = masked_sum(x, m, dim)
    count = m.sum() if dim is None else m.sum(dim)
    count = count.to(total.dtype)
    safe = torch.where(count > 0, count, torch.ones_like(count))
    return torch.where(count > 0, total / safe, torch.zeros_like(total))


def masked_var(x: Tensor, mask: Tensor, *, unbiased: bool = False) -> Tensor:
    """Variance of all valid elements of `x` (one scalar over every masked element).

    Formula: μ = masked_mean(x); Var = Σ m·(x − μ)² / n with n = Σ m (population variance), or
    / (n − 1) when `unbiased` (Bessel's correction, torch.var's default).
    Shapes: x (...) any float dtype; mask same shape. Returns a 0-d tensor of x's dtype.
    Convention: with no valid element, or with a single one and `unbiased=True`, the variance is
    returned as 0 instead of NaN (no data, no spread); this is checked without a host sync.
    Raises: ValueError if mask's shape differs from x's.
    """
    m = _check_mask(x, mask)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    if unbiased:
        n = m.sum().to(var.dtype)
        denom = torch.where(n > 1, n - 1, torch.ones_like(n))
        var = torch.where(n > 1, var * n / denom, torch.zeros_like(var))
    return var


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise `x` to zero mean and unit variance over all valid elements.

    Formula: (x − μ)·rsqrt(σ² + eps), with μ, σ² the masked mean and population variance
    (`masked_var(unbiased=False)`) over every valid element; with `shift_mean=False` the mean is
    added back, μ + (x − μ)·rsqrt(σ² + eps), which rescales without re-centring.
    Shapes: x (...) any float dtype; mask same shape. Returns x's shape and dtype; padding is 0.
    Source: `whiten` in OpenAI lm-human-preferences (Ziegler et al. 2019, arXiv 1909.08593), which
    uses the population variance. Departure from TRL's `masked_whiten`: TRL uses the unbiased
    variance; the two differ by a factor √(n/(n−1)), negligible over a batch of tokens.
    Raises: ValueError if mask's shape differs from x's, or eps < 0.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    m = _check_mask(x, mask)
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=False)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, 0.0)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that count only real tokens: cumsum(mask) − 1, clamped at 0 on left padding.

    `attention_mask` (B, T), any dtype, 1 on real tokens; returns (B, T) long. Shared by the
    sampler and the reward / value heads, which must see the same positions as the policy.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def upcast(x: Tensor) -> Tensor:
    """`x` in the dtype that losses are computed in: float64 stays float64 (a `model.dtype:
    float64` run keeps its precision end to end), every other dtype (bf16, fp16, fp32, ints)
    becomes float32. Same shape; differentiable (the gradient is cast back)."""
    return x.to(_compute_dtype(x))


def _check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _check_logits(logits: Tensor) -> None:
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(
            f"logits must have a non-empty last (vocab) dim, got {tuple(logits.shape)}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got dtype {logits.dtype}")


class _SelectiveLogSoftmax(torch.autograd.Function):
    """log softmax(z)[index] by row-chunks; backward recomputes softmax chunk by chunk.

    Saves only the input logits (already alive in the model's graph), the index and the per-row
    logsumexp, so no float32 copy of the (N, V) logits outlives a chunk.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, index: Tensor, chunk_size: int) -> Tensor:  # (N, V), (N,)
        n = logits.shape[0]
        dt = _compute_dtype(logits)
        out = torch.empty(n, dtype=dt, device=logits.device)
        lse = torch.empty(n, dtype=dt, device=logits.device)
        for start in range(0, n, chunk_size):
            z = logits[start : start + chunk_size].to(dt)  # (C, V)
            idx = index[start : start + chunk_size, None]  # (C, 1)
            lse[start : start + chunk_size] = torch.logsumexp(z, dim=-1)
            out[start : start + chunk_size] = (
                z.gather(-1, idx).squeeze(-1) - lse[start : start + chunk_size]
            )
        ctx.save_for_backward(logits, index, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):  # (N,)
        logits, index, lse = ctx.saved_tensors
        chunk_size = ctx.chunk_size
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            g = grad_out[sl].to(lse.dtype)[:, None]  # (C, 1)
            p = torch.exp(logits[sl].to(lse.dtype) - lse[sl, None])  # (C, V)
            gz = -g * p  # d/dz_k [z_i − lse(z)] = 1[k=i] − p_k
            gz.scatter_add_(-1, index[sl, None], g)
            grad[sl] = gz.to(grad.dtype)
        return grad, None, None


def selective_log_softmax(logits: Tensor, index: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Log-probability of the chosen tokens, log softmax(z)[index], without a full log-softmax.

    Formula: log p(i) = z_i − logsumexp(z), computed in float32 on row-chunks of `logits.float()`
    (rows = the flattened leading dims), so peak extra memory is one (chunk_size, V) float32 block
    instead of a float32 copy of the whole (..., V) tensor. The backward pass recomputes the softmax
    chunk by chunk (grad_z = g·(onehot(i) − softmax(z))); it is first-order differentiable only.
    Shapes: logits (..., V) any float dtype (bf16/fp16/fp32/fp64); index (...) long, same leading
    shape. Returns (...) float32 (float64 when logits are float64).
    Equal to torch.log_softmax(logits.float(), -1).gather(-1, index[..., None])[..., 0] to ~1e-6.
    Raises: ValueError if shapes disagree, index is not an integer tensor, or chunk_size < 1.
    """
    _check_chunk_size(chunk_size)
    _check_logits(logits)
    if index.shape != logits.shape[:-1]:
        raise ValueError(
            f"index has shape {tuple(index.shape)}, expected logits' leading shape {tuple(logits.shape[:-1])}"
        )
    if index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"index must be an integer (long) tensor, got dtype {index.dtype}")
    lead = index.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_index = index.reshape(-1).long()
    out = _SelectiveLogSoftmax.apply(flat_logits, flat_index, chunk_size)
    return out.reshape(lead)


class _EntropyFromLogits(torch.autograd.Function):
    """Entropy of softmax(z) by row-chunks; backward recomputes softmax chunk by chunk."""

    @staticmethod
    def forward(ctx, logits: Tensor, chunk_size: int) -> Tensor:  # (N, V)
        n = logits.shape[0]
        dt = _compute_dtype(logits)
        out = torch.empty(n, dtype=dt, device=logits.device)
        for start in range(0, n, chunk_size):
            out[start : start + chunk_size] = _entropy_rows(
                logits[start : start + chunk_size].to(dt)
            )
        ctx.save_for_backward(logits, out)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):  # (N,)
        logits, ent = ctx.saved_tensors
        chunk_size = ctx.chunk_size
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            logp = torch.log_softmax(logits[sl].to(ent.dtype), dim=-1)  # (C, V)
            p = logp.exp()
            # dH/dz_k = −p_k·(log p_k + H); p_k = 0 terms are exactly 0 (also for z_k = −inf)
            term = torch.where(
                p > 0, p * (logp + ent[sl, None]), torch.zeros((), dtype=p.dtype, device=p.device)
            )
            grad[sl] = (-grad_out[sl].to(ent.dtype)[:, None] * term).to(grad.dtype)
        return grad, None


def _entropy_rows(z: Tensor) -> Tensor:  # (C, V) float -> (C,)
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros((), dtype=z.dtype, device=z.device)).sum(-1)


def entropy_from_logits(logits: Tensor, *, chunk_size: int = 1024) -> Tensor:
    """Entropy of the categorical distribution softmax(logits) at every position.

    Formula: H = logsumexp(z) − Σ_k softmax(z)_k·z_k, computed as the equal −Σ_k p_k·log p_k in
    float32 on row-chunks (rows = flattened leading dims), so tokens with z_k = −inf (p_k = 0)
    contribute exactly 0 instead of NaN. Peak extra memory is one (chunk_size, V) float32 block; the
    backward pass recomputes the softmax per chunk (dH/dz_k = −p_k·(log p_k + H)), first order only.
    Shapes: logits (..., V) any float dtype. Returns (...) float32 (float64 for float64 logits).
    Raises: ValueError if logits are not float or chunk_size < 1.
    """
    _check_chunk_size(chunk_size)
    _check_logits(logits)
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    return _EntropyFromLogits.apply(flat, chunk_size).reshape(lead)


#: Elements (rows × vocab) of one float32 block of the fused head: 8 Mi floats = 32 MiB.
_FUSED_BLOCK = 1 << 23


class _LinearSelectiveLogSoftmax(torch.autograd.Function):
    """log softmax(h·Wᵀ + b)/τ)[index] by row-chunks, never holding the (N, V) logits.

    Forward keeps per-row logsumexp only; backward recomputes each chunk's logits and returns
    the gradients of the hidden states, the weight and the bias (first order). `mm_dtype`: the
    dtype of the head's matmuls (autocast's, cast here explicitly so that forward and backward
    use the same logits); None: the weight's own dtype."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, index, temperature, chunk_size, with_entropy, mm_dtype):
        n = hidden.shape[0]
        dt = _compute_dtype(hidden)
        out = torch.empty(n, dtype=dt, device=hidden.device)
        lse = torch.empty(n, dtype=dt, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=dt, device=hidden.device)
        w, b = _mm_operands(weight, bias, mm_dtype)  # one cast of the head, not one per chunk
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk_size):
                sl = slice(start, start + chunk_size)
                z = _chunk_logits(hidden[sl], w, b, temperature, dt)  # (C, V)
                lse[sl] = torch.logsumexp(z, dim=-1)
                out[sl] = z.gather(-1, index[sl, None]).squeeze(-1) - lse[sl]
                if with_entropy:
                    ent[sl] = _entropy_rows(z)
        del w, b
        ctx.save_for_backward(hidden, weight, bias, index, lse)
        ctx.temperature, ctx.chunk_size, ctx.mm_dtype = temperature, chunk_size, mm_dtype
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_ent):
        hidden, weight, bias, index, lse = ctx.saved_tensors
        tau, chunk_size = ctx.temperature, ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=lse.dtype) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=lse.dtype) if need_b and bias is not None else None
        w, b = _mm_operands(weight, bias, ctx.mm_dtype)
        # The head's matmuls in the dtype its forward ran in (as nn.Linear's backward does): a
        # 16-bit head (autocast, a bf16 model) takes grad_z cast to 16 bits; gradients of the
        # weight and bias are accumulated over chunks in float32 (float64 for float64 inputs).
        mm = w.dtype
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_size):
                sl = slice(start, start + chunk_size)
                z = _chunk_logits(hidden[sl], w, b, tau, lse.dtype)  # (C, V)
                g = grad_out[sl].to(lse.dtype)[:, None]  # (C, 1)
                gz = torch.exp(z - lse[sl, None]).mul_(-g)  # d/dz_k [z_i − lse(z)] = 1[k=i] − p_k
                gz.scatter_add_(-1, index[sl, None], g)
                if tau != 1.0:
                    gz = gz / tau  # z = (h·Wᵀ + b) / τ
                if grad_b is not None:
                    grad_b += gz.sum(0)
                gz = gz.to(mm)
                if need_h:
                    grad_h[sl] = (gz @ w).to(grad_h.dtype)
                if need_w:
                    grad_w += gz.T @ hidden[sl].to(mm)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _mm_operands(
    weight: Tensor, bias: Tensor | None, mm_dtype: torch.dtype | None
) -> tuple[Tensor, Tensor | None]:
    """The head's weight and bias in the matmul dtype (unchanged when None or already so)."""
    if mm_dtype is None or weight.dtype == mm_dtype:
        return weight, bias
    return weight.to(mm_dtype), (bias.to(mm_dtype) if bias is not None else None)


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, tau: float, dt) -> Tensor:
    h = h if h.dtype == weight.dtype else h.to(weight.dtype)
    z = torch.nn.functional.linear(h, weight, bias).to(dt)
    return z / tau if tau != 1.0 else z


def linear_selective_log_softmax(
    hidden: Tensor,
    weight: Tensor,
    index: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of the chosen tokens under an LM head, without materialising the logits.

    Formula: z = (h·Wᵀ + b) / τ; log p(i) = z_i − logsumexp(z), computed on row-chunks so the
    largest extra block is (chunk_size, V); the backward pass recomputes each chunk's logits
    (grad_z = g·(onehot(i) − softmax(z)) / τ, then grad_h = grad_z·W, grad_W = grad_zᵀ·h). With
    `with_entropy`, also the entropy of softmax(z) per row, detached (no gradient).
    Shapes: hidden (..., H) float; weight (V, H); bias (V,) or None; index (...) long with
    hidden's leading shape. Returns (logp (...), entropy (...) or None), float32 (float64 for
    float64 inputs). chunk_size None picks rows so one block holds about 8 Mi floats.
    Equal to selective_log_softmax(linear(hidden, weight, bias) / τ, index) up to float rounding.
    Precision: the head's matmuls run in the dtype nn.Linear would use here — the autocast dtype
    inside torch.autocast (weight and bias cast once per call, not per chunk), else the weight's
    dtype — and each chunk's logits are upcast to float32 for the log-softmax; the backward's
    matmuls take grad_z cast to that same dtype, as the unfused head's backward does.
    Peak extra memory: a few (chunk_size, V) blocks (a chunk's logits and their gradient), the
    weight's cast when one is needed, and a float32 accumulator of the weight's gradient.
    Raises: ValueError on shape mismatches, a non-integer index or chunk_size < 1.
    """
    if hidden.shape[-1] != weight.shape[-1] or weight.ndim != 2:
        raise ValueError(
            f"hidden (..., {hidden.shape[-1]}) does not match weight {tuple(weight.shape)}"
        )
    if index.shape != hidden.shape[:-1]:
        raise ValueError(
            f"index has shape {tuple(index.shape)}, expected hidden's leading shape {tuple(hidden.shape[:-1])}"
        )
    if index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"index must be an integer (long) tensor, got dtype {index.dtype}")
    if chunk_size is None:
        chunk_size = max(1, _FUSED_BLOCK // weight.shape[0])
    _check_chunk_size(chunk_size)
    device = hidden.device.type
    mm_dtype = None  # autocast leaves float64 alone
    if torch.is_autocast_enabled(device) and torch.float64 not in (hidden.dtype, weight.dtype):
        mm_dtype = torch.get_autocast_dtype(device)
    lead = index.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    logp, ent = _LinearSelectiveLogSoftmax.apply(
        flat_h,
        weight,
        bias,
        index.reshape(-1).long(),
        float(temperature),
        chunk_size,
        with_entropy,
        mm_dtype,
    )
    return logp.reshape(lead), (ent.reshape(lead) if with_entropy else None)

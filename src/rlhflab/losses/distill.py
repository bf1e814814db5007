"""Divergences of knowledge distillation, per token, between a student p_s and a teacher p_t.

Every full-distribution divergence takes the student's and the teacher's logits at the same
positions, (N, V) each (any float dtype; computed in float32, or float64 when given float64), and
returns the per-position divergence (N,) in nats. With p = softmax(z):

    forward_kl       KL(p_t ‖ p_s) = Σ_v p_t(v) (log p_t(v) − log p_s(v))            (mass-covering)
    reverse_kl       KL(p_s ‖ p_t) = Σ_v p_s(v) (log p_s(v) − log p_t(v))            (mode-seeking)
    generalized_jsd  JSD_β = β KL(p_t ‖ m) + (1 − β) KL(p_s ‖ m),  m = β p_t + (1 − β) p_s,
                     0 < β < 1; β = 0 is forward_kl and β = 1 reverse_kl (GKD, Agarwal et al.
                     2024, arXiv 2306.13649, eq. 1 and §3; TRL's `GKDTrainer.generalized_jsd_loss`
                     uses the same mixture and the same end points). JSD_β → 0 as β → 0 or 1:
                     JSD_β / β → forward KL and JSD_β / (1 − β) → reverse KL, so the end points
                     are the limits up to that scale, not the limits themselves.
    topk_kl          the book's SDPO loss (rlhf-book code/distillation/loss.py): the K tokens of
                     the student's top-K at each position plus one tail bucket holding the rest of
                     the mass, log p_tail = log(1 − Σ_{top-K} p), for student and teacher alike;
                     the KL of the two (K+1)-bucket distributions. `direction` "reverse" (the
                     default) is KL(student ‖ teacher), as the book computes it:
                     `F.kl_div(t_logp, s_logp, log_target=True)`, and PyTorch's
                     `kl_div(input, target)` is Σ target (log target − input), so the student is
                     the target (the book's comment: "Reverse KL = KL(student || teacher)").
                     "forward" is KL(teacher ‖ student). With K = V the tail is empty and this
                     is the exact reverse / forward KL.

The sampled-token form of on-policy distillation (Agarwal et al. 2024; Thinking Machines,
"On-Policy Distillation", 2025) needs only the log-probs of the sampled tokens x_t ~ p_s:

    reverse_kl_sampled   loss_t = sg(log p_s(x_t) − log p_t(x_t)) · log p_s(x_t): a policy
                         gradient with the per-token advantage A_t = −(log p_s − log p_t)(x_t)
                         (sg: no gradient). Its value is not the KL, but its gradient's expectation
                         over x_t ~ p_s is ∇ KL(p_s ‖ p_t) at that position (Σ_x p_s ∇log p_s = 0);
                         `(log p_s − log p_t)(x_t)` itself is the unbiased k1 estimate of the KL.

`chunked_divergence` computes a full-distribution divergence from hidden states and LM heads in
row-chunks, recomputing each chunk's logits in the backward pass (activation checkpointing), so
no (N, V) logits of more than `chunk_size` rows exist at once.

`DIVERGENCES` is the registry (`loss.divergence` of `trainer: distill`): each entry declares what
it needs (full logits of both models, or sampled-token log-probs only; student samples).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


def _logp(z: Tensor) -> Tensor:
    """log_softmax over the last dim in float32 (float64 stays float64)."""
    return torch.log_softmax(z.double() if z.dtype == torch.float64 else z.float(), dim=-1)


def _kl(logp_a: Tensor, logp_b: Tensor) -> Tensor:
    """KL(a ‖ b) = Σ_v a (log a − log b) over the last dim, (N, V) log-probs → (N,); 0·log 0 = 0."""
    a = logp_a.exp()
    diff = torch.where(a > 0, logp_a - logp_b, torch.zeros_like(logp_a))
    return (a * diff).sum(-1)


def forward_kl(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """KL(p_t ‖ p_s) per position: (N, V), (N, V) → (N,) nats."""
    return _kl(_logp(teacher_logits), _logp(student_logits))


def reverse_kl(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """KL(p_s ‖ p_t) per position: (N, V), (N, V) → (N,) nats."""
    return _kl(_logp(student_logits), _logp(teacher_logits))


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, *, beta: float = 0.5) -> Tensor:
    """GKD's generalized JSD_β per position (module doc): (N, V), (N, V) → (N,) nats.

    Raises:
        ValueError: beta outside [0, 1].
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return forward_kl(student_logits, teacher_logits)
    if beta == 1.0:
        return reverse_kl(student_logits, teacher_logits)
    ls, lt = _logp(student_logits), _logp(teacher_logits)
    b = torch.tensor(beta, dtype=ls.dtype, device=ls.device)
    log_m = torch.logaddexp(lt + torch.log(b), ls + torch.log1p(-b))
    return beta * _kl(lt, log_m) + (1.0 - beta) * _kl(ls, log_m)


def topk_buckets(logp: Tensor, index: Tensor) -> Tensor:
    """The (K+1)-bucket log-distribution of the book's SDPO: log p at `index` (N, K) and the tail
    log(1 − Σ_K p), computed as the logsumexp of the other V − K log-probs (the same number,
    without the cancellation of 1 − Σ when Σ is close to 1). (N, V), (N, K) → (N, K+1); with
    K = V the tail is −inf (an empty bucket)."""
    top = logp.gather(-1, index)
    rest = logp.scatter(-1, index, float("-inf"))
    return torch.cat([top, torch.logsumexp(rest, dim=-1, keepdim=True)], dim=-1)


def topk_kl(
    student_logits: Tensor, teacher_logits: Tensor, *, top_k: int = 20, direction: str = "reverse"
) -> Tensor:
    """The book's SDPO divergence per position (module doc): (N, V), (N, V) → (N,) nats. The
    buckets are the student's top-K tokens (chosen without gradient) plus the tail.
    `direction`: "reverse" = KL(student ‖ teacher) over the buckets, the book's (default);
    "forward" = KL(teacher ‖ student).

    Raises:
        ValueError: top_k < 1 or direction not "reverse" / "forward".
    """
    if top_k < 1:
        raise ValueError(f"topk_kl: top_k must be >= 1, got {top_k}")
    if direction not in ("reverse", "forward"):
        raise ValueError(f"topk_kl: direction must be 'reverse' or 'forward', got {direction!r}")
    ls, lt = _logp(student_logits), _logp(teacher_logits)
    k = min(top_k, ls.size(-1))
    index = ls.detach().topk(k, dim=-1).indices
    bs, bt = topk_buckets(ls, index), topk_buckets(lt, index)
    return _kl(bs, bt) if direction == "reverse" else _kl(bt, bs)


def reverse_kl_sampled(logp_student: Tensor, logp_teacher: Tensor) -> tuple[Tensor, Tensor]:
    """The sampled-token estimator of on-policy distillation (module doc).

    Args:
        logp_student: (B, T) log p_s of the sampled tokens, with gradient.
        logp_teacher: (B, T) log p_t of the same tokens (no gradient needed).
    Returns:
        (loss (B, T): sg(log p_s − log p_t) · log p_s, whose gradient is the policy gradient
        with advantage −(log p_s − log p_t); k1 (B, T): log p_s − log p_t, detached, the
        unbiased per-token estimate of KL(p_s ‖ p_t)).
    """
    k1 = (logp_student - logp_teacher).detach()
    return k1 * logp_student, k1


@dataclass(frozen=True)
class Divergence:
    """A registry entry. `needs`: "full" (the student's and the teacher's logits over the whole
    vocabulary at every completion position: `fn(student_logits, teacher_logits, **args)`) or
    "sampled" (the two models' log-probs of the sampled tokens only: `fn(logp_s, logp_t)`).
    `student_samples`: valid only on completions sampled from the student (the estimator's
    expectation is over x ~ p_s), so GKD's off-policy batches cannot use it."""

    fn: Callable
    needs: str = "full"
    student_samples: bool = False

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


DIVERGENCES: dict[str, Divergence] = {
    "forward_kl": Divergence(forward_kl),
    "reverse_kl": Divergence(reverse_kl),
    "generalized_jsd": Divergence(generalized_jsd),
    "topk_kl": Divergence(topk_kl),
    "reverse_kl_sampled": Divergence(reverse_kl_sampled, needs="sampled", student_samples=True),
}


def _chunk_terms(fn: Callable, kwargs: dict, tau: float, h_s, w_s, b_s, h_t, w_t, b_t):
    """One chunk: logits of both heads over τ (student with gradient), the divergence and,
    detached, the exact reverse KL and whether the two argmaxes agree."""
    z_s = torch.nn.functional.linear(h_s, w_s, b_s)
    with torch.no_grad():
        z_t = torch.nn.functional.linear(h_t, w_t, b_t)
    if tau != 1.0:
        z_s, z_t = z_s / tau, z_t / tau
    div = fn(z_s, z_t, **kwargs)
    with torch.no_grad():
        rkl = reverse_kl(z_s.detach(), z_t)
        agree = (z_s.detach().argmax(-1) == z_t.argmax(-1)).to(rkl.dtype)
    return div, rkl, agree


def chunked_divergence(
    hidden_s: Tensor,
    weight_s: Tensor,
    hidden_t: Tensor,
    weight_t: Tensor,
    fn: Callable,
    *,
    bias_s: Tensor | None = None,
    bias_t: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    **kwargs,
) -> tuple[Tensor, Tensor, Tensor]:
    """A full-distribution divergence `fn(student_logits, teacher_logits, **kwargs)` at N
    positions, computed from hidden states and LM heads in row-chunks.

    Args:
        hidden_s: (N, H_s) the student's last hidden states (with gradient).
        weight_s, bias_s: the student's LM head, (V, H_s) and (V,) or None.
        hidden_t: (N, H_t) the teacher's (no gradient flows into it).
        weight_t, bias_t: the teacher's head, (V, H_t) and (V,) or None.
        temperature: τ; both distributions are softmax(logits / τ) (TRL's GKD does the same).
        chunk_size: rows per chunk; each chunk's logits are recomputed in the backward pass
            (`torch.utils.checkpoint`), so peak memory holds one chunk's (chunk, V) logits.
    Returns:
        (div (N,) with gradient, reverse KL (N,) exact and detached, argmax agreement (N,) 0/1
        detached), float32 (float64 for float64 inputs).
    Raises:
        ValueError: the rows or the vocabularies of the two sides differ.
    """
    from torch.utils.checkpoint import checkpoint

    if hidden_s.size(0) != hidden_t.size(0) or weight_s.size(0) != weight_t.size(0):
        raise ValueError(
            f"chunked_divergence: student {tuple(hidden_s.shape)} x head {tuple(weight_s.shape)} "
            f"vs teacher {tuple(hidden_t.shape)} x head {tuple(weight_t.shape)}: rows and "
            "vocabulary must match"
        )
    if chunk_size < 1:
        raise ValueError(f"chunked_divergence: chunk_size must be >= 1, got {chunk_size}")
    hidden_t, weight_t = hidden_t.detach(), weight_t.detach()
    bias_t = bias_t.detach() if bias_t is not None else None
    outs = []
    for i in range(0, hidden_s.size(0), chunk_size):
        sl = slice(i, i + chunk_size)
        args = (hidden_s[sl], weight_s, bias_s, hidden_t[sl], weight_t, bias_t)
        if torch.is_grad_enabled() and (hidden_s.requires_grad or weight_s.requires_grad):
            outs.append(
                checkpoint(_chunk_terms, fn, kwargs, temperature, *args, use_reentrant=False)
            )
        else:
            outs.append(_chunk_terms(fn, kwargs, temperature, *args))
    if not outs:
        z = hidden_s.new_zeros(0, dtype=torch.float32)
        return z + (hidden_s.sum() + weight_s.sum()) * 0, z, z  # keeps the graph for DDP/FSDP
    return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))  # type: ignore[return-value]

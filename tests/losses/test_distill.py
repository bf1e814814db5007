"""The divergences of rlhflab.losses.distill against their definitions, in float64.

Hand-computed distributions (closed forms written out in the test), the limits of the
generalized JSD, TRL's `GKDTrainer.generalized_jsd_loss` (TRL is not installed here: `trl_gjsd`
below is its formula, re-typed from trl/trainer/gkd_trainer.py), the gradient of the sampled
estimator against autograd of the full-distribution reverse KL, SDPO's top-K + tail bucket
against the exact KL, and the chunked computation against the plain one.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rlhflab.losses.distill import (
    DIVERGENCES,
    chunked_divergence,
    forward_kl,
    generalized_jsd,
    reverse_kl,
    reverse_kl_sampled,
    topk_buckets,
    topk_kl,
)

D = torch.float64


def logits_of(*probs) -> torch.Tensor:
    """(N, V) logits whose softmax is each row of `probs`."""
    return torch.tensor(probs, dtype=D).log()


P = [0.5, 0.3, 0.2]  # student
Q = [0.2, 0.2, 0.6]  # teacher


def kl_by_hand(a, b) -> float:
    return sum(x * math.log(x / y) for x, y in zip(a, b, strict=True))


def test_forward_and_reverse_kl_by_hand():
    s, t = logits_of(P), logits_of(Q)
    # forward: KL(teacher ‖ student) = 0.2 ln(0.2/0.5) + 0.2 ln(0.2/0.3) + 0.6 ln(0.6/0.2)
    fwd = 0.2 * math.log(0.4) + 0.2 * math.log(2 / 3) + 0.6 * math.log(3.0)
    rev = 0.5 * math.log(2.5) + 0.3 * math.log(1.5) + 0.2 * math.log(1 / 3)
    assert forward_kl(s, t).item() == pytest.approx(fwd, abs=1e-12)
    assert reverse_kl(s, t).item() == pytest.approx(rev, abs=1e-12)
    assert fwd != pytest.approx(rev, abs=1e-3)  # the two directions differ here


def test_kl_with_a_zero_probability():
    # 0·log 0 = 0: a student with no mass on token 0 pays nothing there in the reverse KL; the
    # forward KL is infinite (the teacher has mass where the student has none)
    s = torch.tensor([[-math.inf, math.log(0.5), math.log(0.5)]], dtype=D)
    t = logits_of(Q)
    assert reverse_kl(s, t).item() == pytest.approx(
        0.5 * math.log(0.5 / 0.2) + 0.5 * math.log(0.5 / 0.6), abs=1e-12
    )
    assert forward_kl(s, t).item() == math.inf


def test_jsd_by_hand_and_end_points():
    s, t = logits_of(P), logits_of(Q)
    beta = 0.3
    m = [beta * q + (1 - beta) * p for p, q in zip(P, Q, strict=True)]
    want = beta * kl_by_hand(Q, m) + (1 - beta) * kl_by_hand(P, m)
    assert generalized_jsd(s, t, beta=beta).item() == pytest.approx(want, abs=1e-12)
    # β = 0.5 is the symmetric Jensen–Shannon divergence, ≤ ln 2
    m = [(p + q) / 2 for p, q in zip(P, Q, strict=True)]
    js = 0.5 * kl_by_hand(P, m) + 0.5 * kl_by_hand(Q, m)
    assert generalized_jsd(s, t, beta=0.5).item() == pytest.approx(js, abs=1e-12)
    assert js < math.log(2)
    assert torch.equal(generalized_jsd(s, t, beta=0.0), forward_kl(s, t))
    assert torch.equal(generalized_jsd(s, t, beta=1.0), reverse_kl(s, t))


def test_jsd_limits_scale_to_the_two_kls():
    s, t = logits_of(P), logits_of(Q)
    for eps in (1e-4, 1e-6):
        assert (generalized_jsd(s, t, beta=eps) / eps).item() == pytest.approx(
            forward_kl(s, t).item(), rel=10 * eps
        )
        assert (generalized_jsd(s, t, beta=1 - eps) / eps).item() == pytest.approx(
            reverse_kl(s, t).item(), rel=10 * eps
        )


def trl_gjsd(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0):
    """TRL's GKDTrainer.generalized_jsd_loss (reduction "batchmean"), re-typed from its source."""
    student_logits = student_logits / temperature
    teacher_logits = teacher_logits / temperature
    student_log_probs = F.log_softmax(student_logits, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
    if beta == 0:
        jsd = F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True)
    else:
        beta_t = torch.tensor(beta, dtype=student_log_probs.dtype)
        mixture = torch.logsumexp(
            torch.stack(
                [student_log_probs + torch.log(1 - beta_t), teacher_log_probs + torch.log(beta_t)]
            ),
            dim=0,
        )
        kl_teacher = F.kl_div(mixture, teacher_log_probs, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture, student_log_probs, reduction="none", log_target=True)
        jsd = beta_t * kl_teacher + (1 - beta_t) * kl_student
    mask = labels != -100
    return jsd[mask].sum() / mask.sum()


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generalized_jsd_equals_trl(beta, temperature):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 5, 11, generator=g, dtype=D) * 2
    t = torch.randn(2, 5, 11, generator=g, dtype=D) * 2
    labels = torch.ones(2, 5, dtype=torch.long)
    labels[0, 3:] = -100
    ours_tok = generalized_jsd(s[labels != -100] / temperature, t[labels != -100] / temperature,
                               beta=beta)  # fmt: skip
    ours = ours_tok.sum() / (labels != -100).sum()  # TRL's "batchmean": the token mean
    assert ours.item() == pytest.approx(trl_gjsd(s, t, labels, beta, temperature).item(), abs=1e-12)


def test_sampled_estimator_gradient_is_the_reverse_kl_gradient():
    # E_{x ~ p_s}[∇ sampled loss(x)] = ∇ KL(p_s ‖ p_t), exactly, by enumerating x.
    g = torch.Generator().manual_seed(1)
    z = torch.randn(3, 7, generator=g, dtype=D, requires_grad=True)
    zt = torch.randn(3, 7, generator=g, dtype=D)
    reverse_kl(z, zt).sum().backward()
    want = z.grad.clone()
    z.grad = None
    logp_s, logp_t = torch.log_softmax(z, -1), torch.log_softmax(zt, -1)
    p = logp_s.detach().exp()
    expected = torch.zeros_like(z)
    for x in range(7):
        loss, k1 = reverse_kl_sampled(logp_s[:, x], logp_t[:, x])
        (gx,) = torch.autograd.grad(loss.sum(), z, retain_graph=True)
        expected += p[:, x : x + 1] * gx
        assert torch.equal(k1, (logp_s[:, x] - logp_t[:, x]).detach())
    torch.testing.assert_close(expected, want, rtol=1e-12, atol=1e-14)
    # and the closed form: ∂KL/∂z = p_s ⊙ (log p_s − log p_t − KL)
    kl = reverse_kl(z.detach(), zt)[:, None]
    closed = p * (logp_s.detach() - logp_t - kl)
    torch.testing.assert_close(want, closed, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("direction,exact", [("forward", forward_kl), ("reverse", reverse_kl)])
def test_topk_with_k_equal_v_is_the_exact_kl(direction, exact):
    g = torch.Generator().manual_seed(2)
    s, t = torch.randn(4, 9, generator=g, dtype=D), torch.randn(4, 9, generator=g, dtype=D)
    torch.testing.assert_close(
        topk_kl(s, t, top_k=9, direction=direction), exact(s, t), rtol=1e-12, atol=1e-14
    )
    torch.testing.assert_close(
        topk_kl(s, t, top_k=50, direction=direction), exact(s, t), rtol=1e-12, atol=1e-14
    )


def test_topk_tail_bucket_by_hand():
    # student [.5, .3, .2], teacher [.2, .2, .6], K = 1: buckets {token 0, rest}
    s, t = logits_of(P), logits_of(Q)
    bs = topk_buckets(torch.log_softmax(s, -1), torch.tensor([[0]]))
    torch.testing.assert_close(bs.exp(), torch.tensor([[0.5, 0.5]], dtype=D))
    # the tail is log(1 − Σ top-K p), the book's formula
    assert bs[0, 1].item() == pytest.approx(math.log(1 - 0.5), abs=1e-12)
    fwd = kl_by_hand([0.2, 0.8], [0.5, 0.5])  # KL(teacher ‖ student) over the buckets
    rev = kl_by_hand([0.5, 0.5], [0.2, 0.8])  # KL(student ‖ teacher): the default
    assert topk_kl(s, t, top_k=1).item() == pytest.approx(rev, abs=1e-12)
    assert topk_kl(s, t, top_k=1, direction="reverse").item() == pytest.approx(rev, abs=1e-12)
    assert topk_kl(s, t, top_k=1, direction="forward").item() == pytest.approx(fwd, abs=1e-12)
    # K = 2: {0, 1, tail = token 2}: all tokens are their own bucket, so the exact KL
    assert topk_kl(s, t, top_k=2).item() == pytest.approx(kl_by_hand(P, Q), abs=1e-12)


def test_topk_default_is_the_books_direction_student_teacher():
    # One position, V = 4, K = 2. The book (rlhf-book code/distillation/loss.py) computes
    # F.kl_div(t_logp, s_logp, log_target=True), and PyTorch's kl_div(input, target) is
    # Σ target (log target − input): KL(student ‖ teacher). Buckets from the definition, by a naive
    # loop: the student's top-2 tokens are 0 and 1 (logits 2 > 1 > 0 > −1); the tail holds 2 and 3.
    zs, zt = [2.0, 1.0, 0.0, -1.0], [0.0, 1.0, 2.0, -1.0]

    def probs(z):
        e = [math.exp(x) for x in z]
        return [x / sum(e) for x in e]

    p, q = probs(zs), probs(zt)
    p_b, q_b = [p[0], p[1], p[2] + p[3]], [q[0], q[1], q[2] + q[3]]
    student_teacher = sum(a * math.log(a / b) for a, b in zip(p_b, q_b, strict=True))
    teacher_student = sum(b * math.log(b / a) for a, b in zip(p_b, q_b, strict=True))
    assert student_teacher == pytest.approx(1.0810, abs=1e-4)  # the number
    assert teacher_student == pytest.approx(0.9987, abs=1e-4)
    s, t = torch.tensor([zs], dtype=D), torch.tensor([zt], dtype=D)
    assert topk_kl(s, t, top_k=2).item() == pytest.approx(student_teacher, abs=1e-12)
    assert topk_kl(s, t, top_k=2, direction="reverse").item() == pytest.approx(
        student_teacher, abs=1e-12
    )
    assert topk_kl(s, t, top_k=2, direction="forward").item() == pytest.approx(
        teacher_student, abs=1e-12
    )


def test_topk_equals_the_books_add_tail_form():
    # the book: log_sum = logsumexp(top-K log p).clamp(max=-1e-7); tail = log(-expm1(log_sum));
    # kl = F.kl_div(t_logp, s_logp, reduction="none", log_target=True).sum(-1)
    g = torch.Generator().manual_seed(3)
    s, t = torch.randn(5, 12, generator=g, dtype=D), torch.randn(5, 12, generator=g, dtype=D)
    k = 4
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    idx = ls.topk(k, -1).indices

    def add_tail(lp):
        tail = torch.log(-torch.expm1(lp.logsumexp(-1, keepdim=True).clamp(max=-1e-7)))
        return torch.cat([lp, tail], -1)

    bs, bt = add_tail(ls.gather(-1, idx)), add_tail(lt.gather(-1, idx))
    book = F.kl_div(bt, bs, reduction="none", log_target=True).sum(-1)  # (input=t, target=s)
    torch.testing.assert_close(topk_kl(s, t, top_k=k), book, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["forward_kl", "reverse_kl", "generalized_jsd", "topk_kl"])
def test_chunked_equals_plain_values_and_gradients(name):
    g = torch.Generator().manual_seed(4)
    n, h, v = 13, 6, 17
    hs = torch.randn(n, h, generator=g, dtype=D, requires_grad=True)
    ws = torch.randn(v, h, generator=g, dtype=D, requires_grad=True)
    bs = torch.randn(v, generator=g, dtype=D, requires_grad=True)
    ht, wt = torch.randn(n, 5, generator=g, dtype=D), torch.randn(v, 5, generator=g, dtype=D)
    kwargs = {"top_k": 4} if name == "topk_kl" else {}
    fn = DIVERGENCES[name].fn
    tau = 0.8
    plain = fn((hs @ ws.T + bs) / tau, (ht @ wt.T) / tau, **kwargs)
    grads = torch.autograd.grad(plain.sum(), (hs, ws, bs))
    div, rkl, agree = chunked_divergence(
        hs, ws, ht, wt, fn, bias_s=bs, temperature=tau, chunk_size=4, **kwargs
    )
    torch.testing.assert_close(div, plain, rtol=1e-12, atol=1e-14)
    for a, b in zip(torch.autograd.grad(div.sum(), (hs, ws, bs)), grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    zs, zt = (hs @ ws.T + bs).detach() / tau, (ht @ wt.T) / tau
    torch.testing.assert_close(rkl, reverse_kl(zs, zt), rtol=1e-12, atol=1e-14)
    assert torch.equal(agree, (zs.argmax(-1) == zt.argmax(-1)).to(D))


def test_bad_arguments_are_one_line_errors():
    s = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(s, s, beta=1.5)
    with pytest.raises(ValueError, match="top_k must be"):
        topk_kl(s, s, top_k=0)
    with pytest.raises(ValueError, match="direction"):
        topk_kl(s, s, direction="both")
    with pytest.raises(ValueError, match="vocabulary must match"):
        chunked_divergence(s, torch.zeros(3, 3), s, torch.zeros(4, 3), reverse_kl)

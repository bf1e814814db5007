"""Issue #29's estimators, surrogates, KL variants and rollout corrections against hand arithmetic
or a naive Python loop, in float64 (each function's docstring gives its formula and source)."""

import math

import pytest
import torch

from rlhflab.losses import advantages as A
from rlhflab.losses import correction as C
from rlhflab.losses import kl
from rlhflab.losses import policy as P

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def close(a, b, tol=1e-12):
    torch.testing.assert_close(a, b if torch.is_tensor(b) else t(b), rtol=0, atol=tol)


def _whiten_loop(values: list[list[float]]) -> list[list[float]]:
    """Whitening over every element of a ragged list of rows (plain Python), with the unbiased
    variance Σ(v − mean)²/(n − 1), as verl's masked_whiten (Bessel's correction)."""
    flat = [v for row in values for v in row]
    mean = sum(flat) / len(flat)
    var = sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in values]


def _ragged(x: torch.Tensor, lengths: list[int]) -> list[list[float]]:
    return [x[i, :n].tolist() for i, n in enumerate(lengths)]


LENGTHS = [2, 1, 3, 1]
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])


# --- advantages ----------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_is_whitened_return_to_go(gamma):
    tok_r = t([[0.1, -0.2, 9.0], [1.0, 9.0, 9.0], [0.0, 0.3, 1.0], [-1.0, 9.0, 9.0]])  # 9: padding
    returns = []
    for i, n in enumerate(LENGTHS):  # G_t = Σ_{s≥t} γ^{s−t} r_s, by hand
        row = tok_r[i, :n].tolist()
        returns.append([sum(gamma ** (s - k) * row[s] for s in range(k, n)) for k in range(n)])
    adv = A.reinforce_pp(tok_r, MASK, gamma=gamma)
    for got, want in zip(_ragged(adv, LENGTHS), _whiten_loop(returns), strict=True):
        assert got == pytest.approx(want, abs=1e-12)
    assert torch.equal(adv[~MASK.bool()], torch.zeros(5, dtype=F64))
    # a sequence reward (B,) sits at the last valid token
    seq = A.reinforce_pp(t([1.0, 0.0, 0.0, 1.0]), MASK)
    want = _whiten_loop([[1.0, 1.0], [0.0], [0.0, 0.0, 0.0], [1.0]])
    for got, w in zip(_ragged(seq, LENGTHS), want, strict=True):
        assert got == pytest.approx(w, abs=1e-12)


def test_reinforce_pp_baseline_group_mean_then_token_whitening():
    r = t([1.0, 0.0, 1.0, 1.0])  # G = 2: groups [1, 0] and [1, 1]
    adv = A.reinforce_pp_baseline(r, MASK, group_size=2)
    # A' = [0.5, −0.5, 0, 0] broadcast over 2, 1, 3, 1 tokens, then whitened over the 7 tokens
    want = _whiten_loop([[0.5, 0.5], [-0.5], [0.0, 0.0, 0.0], [0.0]])
    for got, w in zip(_ragged(adv, LENGTHS), want, strict=True):
        assert got == pytest.approx(w, abs=1e-12)


def _verl_masked_whiten(values, mask):
    """verl/utils/torch_functional.py masked_mean / masked_var(unbiased=True) / masked_whiten,
    re-typed (verl is not installed here)."""

    def masked_mean(v, m):
        return (v * m).sum() / (m.sum() + 1e-8)

    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    n = mask.sum()
    var = var * (n / (n - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _verl_reinforce_plus_plus(token_level_rewards, response_mask, gamma):
    """verl core_algos.compute_reinforce_plus_plus_outcome_advantage, re-typed."""
    returns = torch.zeros_like(token_level_rewards)
    running_return = 0
    for t_ in reversed(range(token_level_rewards.shape[1])):
        running_return = token_level_rewards[:, t_] + gamma * running_return
        returns[:, t_] = running_return
        running_return = running_return * response_mask[:, t_]
    return _verl_masked_whiten(returns, response_mask) * response_mask


def _verl_reinforce_plus_plus_baseline(token_level_rewards, response_mask, index):
    """verl core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage, re-typed."""
    scores = token_level_rewards.sum(dim=-1)
    groups = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(scores[i])
    means = {g: torch.mean(torch.stack(v)) for g, v in groups.items()}
    scores = torch.stack([scores[i] - means[g] for i, g in enumerate(index)])
    scores = scores.unsqueeze(-1).tile([1, token_level_rewards.shape[-1]]) * response_mask
    return _verl_masked_whiten(scores, response_mask) * response_mask


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_aliases_give_verls_values(gamma):
    # ADVANTAGE_ALIASES maps verl's "reinforce_plus_plus(_baseline)" to ours: same numbers, float32
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]] * 2)
    outcome = torch.rand(8, generator=g)
    last = mask.sum(-1) - 1
    tok = torch.zeros(8, 5)
    tok[torch.arange(8), last] = outcome
    tok = tok + 0.1 * torch.randn(8, 5, generator=g) * mask  # a per-token KL-like term
    ours = A.reinforce_pp(tok, mask, gamma=gamma)
    torch.testing.assert_close(ours, _verl_reinforce_plus_plus(tok, mask.float(), gamma))
    ours_b = A.reinforce_pp_baseline(outcome, mask, group_size=2)
    outcome_tok = torch.zeros(8, 5)
    outcome_tok[torch.arange(8), last] = outcome
    theirs_b = _verl_reinforce_plus_plus_baseline(
        outcome_tok, mask.float(), [0, 0, 1, 1, 2, 2, 3, 3]
    )
    torch.testing.assert_close(ours_b, theirs_b)
    assert A.ADVANTAGE_ALIASES["reinforce_plus_plus"] == "reinforce_pp"
    assert A.ADVANTAGE_ALIASES["reinforce_plus_plus_baseline"] == "reinforce_pp_baseline"


def test_remax_subtracts_greedy_reward():
    close(A.remax(t([1.0, 0.0, 1.0]), baseline=t([1.0, 1.0, 0.0])), [0.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="baseline"):
        A.remax(t([1.0, 0.0]), baseline=t([1.0]))


def test_opo_length_weighted_baseline():
    # group 0: r [1, 0], lengths [2, 1] -> b = 2/3; group 1: r [1, 1] -> exactly 0
    close(A.opo(t([1.0, 0.0, 1.0, 1.0]), MASK, group_size=2), [1 / 3, -2 / 3, 0.0, 0.0])
    # lengths 3 and 1, rewards 0.5 and 1: b = (1.5 + 1)/4
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    close(A.opo(t([0.5, 1.0]), m, group_size=2), [0.5 - 0.625, 1.0 - 0.625])


def test_gpg_alpha_counts_samples_without_gradient():
    r = t([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])  # one varying group of 2 out of B = 6: M = 4, α = 3
    close(A.gpg(r, group_size=2), [1.5, -1.5, 0.0, 0.0, 0.0, 0.0])
    std = math.sqrt(0.5)  # Bessel std of [1, 0]
    close(
        A.gpg(r, group_size=2, std_norm=True), [1.5 / (std + 1e-6), -1.5 / (std + 1e-6), 0, 0, 0, 0]
    )
    close(A.gpg(t([1.0, 1.0]), group_size=2), [0.0, 0.0])  # nothing varies: α = 1, A = 0


def test_pass_k_only_the_first_best_sample():
    r = t([0.0, 1.0, 0.0, 0.0, 0.2, 0.9, 0.5, 0.9, 1.0, 1.0, 0.0, 0.0])
    close(A.pass_k(r, group_size=4, std_norm=False), [0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    std0 = torch.std(r[:4]).item()  # Bessel, 0.5
    got = A.pass_k(r, group_size=4)
    assert got[1].item() == pytest.approx(1.0 / (std0 + 1e-6), abs=1e-12)
    assert got[torch.arange(12) != 1].abs().max().item() == 0.0


def test_optimal_token_baseline_naive_loop():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    r = t([1.0, 0.0, 0.5, 1.0])
    logp = -torch.rand(4, 3, generator=g, dtype=F64)
    spp = torch.rand(4, 3, generator=g, dtype=F64)
    adv = A.optimal_token_baseline(r, mask, group_size=2, logp=logp, sum_pi_squared=spp)
    lengths = mask.sum(1).tolist()
    G = [[r[i].item()] * n for i, n in enumerate(lengths)]  # return-to-go of an outcome reward
    W = []
    for i, n in enumerate(lengths):
        acc, row = 0.0, []
        for s in range(n):
            acc += 1 - 2 * math.exp(logp[i, s].item()) + spp[i, s].item()
            row.append(acc)
        W.append(row)
    for grp in (0, 1):
        rows = [2 * grp, 2 * grp + 1]
        for i in rows:
            for s in range(lengths[i]):
                num = sum(W[j][s] * G[j][s] for j in rows if s < lengths[j])
                den = sum(W[j][s] for j in rows if s < lengths[j])
                assert adv[i, s].item() == pytest.approx(G[i][s] - num / (den + 1e-8), abs=1e-12)
    assert torch.equal(adv[~mask.bool()], torch.zeros(4, dtype=F64))


# --- policy losses -------------------------------------------------------------------------------


def _grad(fn, lr, adv, mask=None, **kw):
    """Loss (1, T) and d loss / d logp for log-ratios `lr` (logp_old = 0)."""
    logp = t([lr]).requires_grad_(True)
    mask = torch.ones(1, len(lr)) if mask is None else mask
    loss, stats = fn(logp, torch.zeros_like(logp), t([adv]), mask, **kw)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    return loss.detach()[0], g[0], stats


def test_dual_clip_bounds_negative_advantages():
    r = [4.0, 2.0, 0.5, 1.0]
    loss, g, st = _grad(P.ppo_dual_clip, [math.log(x) for x in r], -1.0, clip_c=3.0)
    # A = −1: min(r·A, clip(r)·A) = [−4, −2, −0.8, −1]; max with c·A = −3 -> [−3, −2, −0.8, −1]
    close(loss, [3.0, 2.0, 0.8, 1.0])
    close(g, [0.0, 2.0, 0.0, 1.0])  # −A·r where the ratio term is active, 0 where a bound binds
    close(st["clipped_low"][0], [1.0, 0.0, 1.0, 0.0])
    # A > 0: exactly PPO-clip
    lp = t([[0.3, -0.4, 0.05]])
    a, b = (
        P.ppo_dual_clip(lp, lp * 0, t([1.5]), torch.ones(1, 3)),
        P.ppo_clip(lp, lp * 0, t([1.5]), torch.ones(1, 3)),
    )
    assert torch.equal(a[0], b[0])
    with pytest.raises(ValueError, match="clip_c"):
        P.ppo_dual_clip(lp, lp, t([1.0]), torch.ones(1, 3), clip_c=1.0)


@pytest.mark.parametrize("adv", [1.5, -0.7])
def test_sapo_soft_gate(adv):
    r = [0.5, 1.0, 1.3, 2.5]
    tau = 1.0 if adv > 0 else 1.05
    loss, g, _ = _grad(P.sapo, [math.log(x) for x in r], adv)
    sig = [1 / (1 + math.exp(-tau * (x - 1))) for x in r]
    close(loss, [-s * 4 / tau * adv for s in sig])
    # d/dlogp: −A·4σ(1−σ)·r, which is −A at r = 1 (the on-policy gradient)
    close(g, [-adv * 4 * s * (1 - s) * x for s, x in zip(sig, r, strict=True)])
    assert g[1].item() == pytest.approx(-adv, abs=1e-12)


def test_gmpo_geometric_mean_clipped_in_log_space():
    mask = torch.tensor([[1, 1, 0]])
    loss, g, st = _grad(P.gmpo, [0.1, 0.6, 7.0], 1.0, mask)  # 7.0: padding garbage
    rho = math.exp((0.1 + 0.4) / 2)  # A > 0: log-ratio 0.6 clipped to 0.4
    close(loss, [-rho, -rho, 0.0])
    close(g, [-rho, 0.0, 0.0])  # 2 equal token losses, each ∂(−A ρ)/∂logp_0 = −A ρ / 2
    close(st["clipped_high"][0], [0.0, 1.0, 0.0])
    loss, g, _ = _grad(P.gmpo, [-0.6, 0.1, 0.0], -1.0, mask)
    rho = math.exp((-0.4 + 0.1) / 2)  # A < 0: the low side (−0.6) is clipped to −0.4
    close(loss, [rho, rho, 0.0])
    close(g, [0.0, rho, 0.0])
    # A < 0 and a log-ratio above eps_high: not clipped (the objective pushes it down), so it keeps
    # its gradient and is counted in neither clip stat
    loss, g, st = _grad(P.gmpo, [0.6, 0.1], -1.0)
    rho = math.exp((0.6 + 0.1) / 2)
    close(g, [rho, rho])  # 2 token losses of −A·ρ, each ∂/∂logp_t = −A·ρ/2
    close(st["clipped_low"] + st["clipped_high"], [[0.0, 0.0]])


def test_gmpo_per_token_advantage_clips_by_the_row_means_sign():
    # the difference from verl's geo_mean documented in `gmpo`: A = [+1, −3] (row mean −1),
    # log-ratios [0.5, 0.5], eps 0.4. Here the clip side follows sgn(Ā) = −1: the objective
    # −Ā·ρ = ρ is not raised by a larger ratio, so nothing is clipped: ρ = e^0.5, loss = e^0.5.
    # verl's code clips token 0 (its A > 0) on the high side: ρ = e^((0.4 + 0.5)/2).
    lp = t([[0.5, 0.5]])
    loss, st = P.gmpo(lp, lp * 0, t([[1.0, -3.0]]), torch.ones(1, 2))
    close(loss, [[math.exp(0.5), math.exp(0.5)]])
    close(st["ratio"], [[math.exp(0.5), math.exp(0.5)]])
    close(st["clipped_high"] + st["clipped_low"], [[0.0, 0.0]])


def _cov_loop(logp_old, adv, mask):
    cells = [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]]
    a_mean = sum(adv[i].item() for i, _ in cells) / len(cells)
    l_mean = sum(logp_old[i, j].item() for i, j in cells) / len(cells)
    return {(i, j): (adv[i].item() - a_mean) * (logp_old[i, j].item() - l_mean) for i, j in cells}


def test_cov_selections_naive_loop():
    g = torch.Generator().manual_seed(1)
    logp_old = -3 * torch.rand(4, 5, generator=g, dtype=F64)
    adv = t([2.0, -1.5, 0.5, -3.0])
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] * 4 + [0], [1] * 2 + [0] * 3])
    cov = _cov_loop(logp_old, adv, mask)
    # KL-Cov: the top ⌊ratio·N⌋ cells by covariance
    sel = P.kl_cov_selection(logp_old, adv, mask, cov_ratio=0.25)  # N = 14 -> 3
    top = sorted(cov, key=lambda c: -cov[c])[:3]
    assert {tuple(x) for x in sel.nonzero().tolist()} == set(top)
    # Clip-Cov: ratio 1 takes every candidate with lb < cov < ub
    lb, ub = -0.5, 0.8
    sel = P.clip_cov_selection(logp_old, adv, mask, cov_ratio=1.0, cov_lb=lb, cov_ub=ub)
    assert {tuple(x) for x in sel.nonzero().tolist()} == {c for c, v in cov.items() if lb < v < ub}
    sel = P.clip_cov_selection(logp_old, adv, mask, cov_ratio=0.15, cov_lb=lb, cov_ub=ub,
                               generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert sel.sum().item() == 2 and all(lb < cov[tuple(c)] < ub for c in sel.nonzero().tolist())


def test_clip_cov_and_kl_cov_losses_on_selected_tokens():
    lr = [0.1, -0.3, 0.25]
    sel = torch.tensor([[False, True, True]])
    base, g_base, _ = _grad(P.ppo_clip, lr, 1.0)
    loss, g, st = _grad(P.clip_cov, lr, 1.0, selected=sel)
    close(loss, base)  # same value, no gradient through the selected tokens
    close(g, [g_base[0].item(), 0.0, 0.0])
    close(st["cov_selected"][0], [0.0, 1.0, 1.0])
    loss, g, _ = _grad(P.kl_cov, lr, -2.0, selected=sel, kl_coef=0.5)
    r = [math.exp(x) for x in lr]
    close(loss, [2 * r[0], 2 * r[1] + 0.5 * 0.3, 2 * r[2] + 0.5 * 0.25])
    close(g, [2 * r[0], 2 * r[1] - 0.5, 2 * r[2] + 0.5])  # d|lr|/dlogp = sign(lr)
    with pytest.raises(ValueError, match="selected"):
        _grad(P.kl_cov, lr, 1.0, selected=torch.ones(2, 3, dtype=torch.bool))


def test_policy_loss_aliases_resolve_to_registered_names():
    assert P.POLICY_LOSS_ALIASES == {
        "vanilla": "ppo_dual_clip",
        "gpg": "reinforce",
        "geo_mean": "gmpo",
    }
    assert set(P.POLICY_LOSS_ALIASES.values()) <= set(P.POLICY_LOSSES)
    declared = {n for n, e in P.POLICY_LOSSES.items() if e.select is not None}
    assert declared == {"clip_cov", "kl_cov"}


# --- KL -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,value_fn", [("k1+", kl.k1), ("k3+", kl.k3), ("abs+", kl.abs_kl)])
def test_straight_through_value_and_k2_gradient(name, value_fn):
    logp = t([-1.0, -2.0, -0.3]).requires_grad_(True)
    ref = t([-1.5, -1.0, -0.3])
    v = kl.KL_ESTIMATORS[name](logp, ref)
    close(v.detach(), value_fn(logp, ref).detach())
    (g,) = torch.autograd.grad(v.sum(), logp)
    close(g, (logp - ref).detach())  # ∂k2/∂logp = logp − logp_ref


def test_abs_estimator():
    close(kl.abs_kl(t([-1.0, -2.0]), t([-1.5, -1.0])), [0.5, 1.0])
    assert kl.KL_ESTIMATOR_ALIASES["kl+"] == "k1+"
    assert "low_var_kl+" in kl.KL_ESTIMATOR_NEAR_MISSES


# --- rollout correction ---------------------------------------------------------------------------

LO = t([[-1.0, -0.5, 0.0], [-2.0, -0.1, 0.0], [-0.3, -0.3, -0.3]])
LS = t([[-1.2, -0.4, 5.0], [-1.0, -0.2, 5.0], [-0.3, -0.6, -0.3]])
RC_MASK = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]])


def test_importance_weights_token_and_sequence():
    w, st = C.importance_weights(LO, LS, RC_MASK, level="token", cap=2.0)
    close(w, [[math.exp(0.2), math.exp(-0.1), 0], [math.exp(-1.0), math.exp(0.1), 0],
              [1.0, math.exp(0.3), 1.0]])  # fmt: skip
    tis_w, _ = C.truncated_importance_weights(LO, LS, RC_MASK, cap=2.0)
    assert torch.equal(w, tis_w)  # token level is TIS's weight
    w, st = C.importance_weights(LO, LS, RC_MASK, level="sequence", cap=1.2)
    seq = [math.exp(0.1), math.exp(-0.9), math.exp(0.3)]  # exp Σ_t (lo − ls)
    close(w, [[seq[0]] * 2 + [0], [seq[1]] * 2 + [0], [1.2] * 3])
    close(st["capped"], [[0, 0, 0], [0, 0, 0], [1, 1, 1]])


def test_batch_normalised_weights_average_one():
    w, _ = C.importance_weights(LO, LS, RC_MASK, level="token", cap=None)
    n = C.normalize_weights(w, RC_MASK, level="token")
    assert n[RC_MASK.bool()].mean().item() == pytest.approx(1.0, abs=1e-12)
    w, _ = C.importance_weights(LO, LS, RC_MASK, level="sequence", cap=None)
    n = C.normalize_weights(w, RC_MASK, level="sequence")
    seq = [math.exp(0.1), math.exp(-0.9), math.exp(0.3)]
    close(n[:, 0], [s / (sum(seq) / 3) for s in seq])
    # explicit (global) sums override the local ones
    close(C.normalize_weights(w, RC_MASK, level="sequence", total=t(4.0), count=t(2.0)), w / 2.0)


def test_rejection_masks():
    keep = C.rejection_mask(LO, LS, RC_MASK, level="token", high=1.2)  # low = 1/1.2
    # token log-ratios 0.2, −0.1 | −1.0, 0.1 | 0, 0.3, 0 vs log 1.2 = 0.182
    close(keep, [[0, 1, 0], [0, 1, 0], [1, 0, 1]])
    keep = C.rejection_mask(LO, LS, RC_MASK, level="sequence", low=0.5, high=1.2)
    close(keep, [[1, 1, 0], [0, 0, 0], [0, 0, 0]])  # Σ: 0.1, −0.9, 0.3
    keep = C.rejection_mask(LO, LS, RC_MASK, level="geometric", low=0.5, high=1.2)
    close(keep, [[1, 1, 0], [1, 1, 0], [1, 1, 1]])  # means 0.05, −0.45, 0.1
    with pytest.raises(ValueError, match="low"):
        C.rejection_mask(LO, LS, RC_MASK, level="token", low=3.0, high=2.0)

"""Direct-alignment (preference) losses on sequence log-probs.

Every paired loss has the signature

    fn(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, *, ...)
        -> (losses (B,), stats)

Inputs are always *summed* token log-probs log π(y|x) = Σ_t log π(y_t | x, y_<t), shape (B,).
Losses defined on *length-averaged* log-probs (DPO-norm, SimPO, ORPO) take the completion lengths
`chosen_lengths` / `rejected_lengths` (B,) as keyword arguments and divide themselves, so which
reduction a method uses is part of the method, stated in its docstring and tested. Reference-free
losses (SimPO, ORPO; hinge optionally) accept None for the reference arguments.

`stats` holds detached per-example tensors (B,) — the trainer reduces them with the loss's
denominator: `chosen_reward`, `rejected_reward` (the method's implicit reward), `margin` (their
difference), `accuracy` (1 where margin > 0), plus method-specific terms.

KTO works on unpaired (prompt, completion, label) data and has its own signature (see `kto`).

What a loss needs from the trainer is declared with it in the registry `PREFERENCE_LOSSES`
(`PreferenceLoss`: reference-free, unpaired, completion lengths), never read off its signature;
`PREFERENCE_ALIASES` maps the field's usual names (TRL's `DPOConfig.loss_type`) onto ours.

Notation: h = (log π_θ(y_w|x) − log π_ref(y_w|x)) − (log π_θ(y_l|x) − log π_ref(y_l|x)), the
reference-normalised log-likelihood margin; σ the logistic function.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "PREFERENCE_ALIASES",
    "PREFERENCE_LOSSES",
    "PreferenceLoss",
    "apo_down",
    "apo_zero",
    "cdpo",
    "dpo",
    "dpo_norm",
    "hinge",
    "ipo",
    "kto",
    "log1mexp",
    "orpo",
    "rpo",
    "simpo",
    "unpaired_loss_names",
]


def _rewards_stats(chosen_reward: Tensor, rejected_reward: Tensor, **extra: Tensor) -> dict:
    c, r = chosen_reward.detach(), rejected_reward.detach()
    stats = {
        "chosen_reward": c,
        "rejected_reward": r,
        "margin": c - r,
        "accuracy": (c > r).to(c.dtype),
    }
    stats.update({k: v.detach() for k, v in extra.items()})
    return stats


def _logratios(
    pc: Tensor, pr: Tensor, rc: Tensor | None, rr: Tensor | None
) -> tuple[Tensor, Tensor]:
    if rc is None or rr is None:
        raise ValueError(
            "this loss needs reference log-probs (ref_chosen_logps, ref_rejected_logps)"
        )
    return pc - rc, pr - rr


def dpo(
    policy_chosen_logps: Tensor,  # (B,) summed log π_θ(y_w|x)
    policy_rejected_logps: Tensor,  # (B,)
    ref_chosen_logps: Tensor,  # (B,)
    ref_rejected_logps: Tensor,  # (B,)
    *,
    beta: float = 0.1,
) -> tuple[Tensor, dict]:
    """DPO — Rafailov et al. 2023, arXiv 2305.18290, eq. 7.

        L = −log σ(β h),   implicit reward r(x, y) = β (log π_θ(y|x) − log π_ref(y|x))

    Log-probs are summed over completion tokens (the paper's log π(y|x); TRL does the same).
    At π_θ = π_ref: h = 0, L = log 2 and ∂L/∂log π_θ(y_w|x) = −β/2.
    """
    cl, rl = _logratios(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    losses = -F.logsigmoid(beta * (cl - rl))
    return losses, _rewards_stats(beta * cl, beta * rl)


def cdpo(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.1,
) -> tuple[Tensor, dict]:
    """Conservative DPO — Mitchell 2023, "A note on DPO with noisy preferences" (cDPO): labels are
    flipped with probability ε = `label_smoothing`:

        L = −(1 − ε) log σ(β h) − ε log σ(−β h)

    Summed log-probs, as DPO. ε = 0 is DPO exactly; its minimiser is h = log((1 − ε)/ε)/β, finite.
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    cl, rl = _logratios(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    z = beta * (cl - rl)
    losses = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return losses, _rewards_stats(beta * cl, beta * rl)


def ipo(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
) -> tuple[Tensor, dict]:
    """IPO — Azar et al. 2023, arXiv 2310.12036, eq. 17 (β is the paper's τ):

        L = (h − 1/(2β))²

    minimised at the margin h = 1/(2β), wherever the data come from. Summed log-probs, as in the
    paper's h; departure from TRL, which averages log-probs over tokens for IPO.
    Reported rewards are β·logratio, as DPO's.
    """
    cl, rl = _logratios(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    losses = (cl - rl - 1.0 / (2.0 * beta)) ** 2
    return losses, _rewards_stats(beta * cl, beta * rl)


def hinge(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    beta: float = 0.1,
) -> tuple[Tensor, dict]:
    """Hinge (SLiC-HF calibration loss) — Zhao et al. 2023, arXiv 2305.10425, §2, with margin
    δ = 1/β, in the reference-normalised form of RSO (Liu et al. 2023, arXiv 2309.06657, §3):

        L = max(0, 1 − β h)

    Summed log-probs. With ref = None, h is the policy-only margin log π_θ(y_w|x) − log π_θ(y_l|x)
    (SLiC's original calibration term; its SFT regulariser is not included).
    """
    if ref_chosen_logps is None or ref_rejected_logps is None:
        cl, rl = policy_chosen_logps, policy_rejected_logps
    else:
        cl, rl = _logratios(
            policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
        )
    losses = torch.relu(1.0 - beta * (cl - rl))
    return losses, _rewards_stats(beta * cl, beta * rl)


def dpo_norm(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    chosen_lengths: Tensor,  # (B,) completion tokens of y_w
    rejected_lengths: Tensor,  # (B,)
    beta: float = 0.1,
) -> tuple[Tensor, dict]:
    """DPO on length-averaged log-probs (the "length-normalised DPO" baseline of SimPO, arXiv
    2405.14734, §4): L = −log σ(β (Δ̄_w − Δ̄_l)), Δ̄ = (log π_θ(y|x) − log π_ref(y|x)) / |y|.

    Log-probs are averaged over completion tokens (lengths supplied by the trainer). Use a β about
    |y| times larger than DPO's for the same effective temperature.
    """
    cl, rl = _logratios(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    cl, rl = cl / chosen_lengths, rl / rejected_lengths
    losses = -F.logsigmoid(beta * (cl - rl))
    return losses, _rewards_stats(beta * cl, beta * rl)


def simpo(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    beta: float = 2.0,
    gamma: float = 1.0,
) -> tuple[Tensor, dict]:
    """SimPO — Meng et al. 2024, arXiv 2405.14734, eq. 6. No reference model:

        L = −log σ( β/|y_w| log π_θ(y_w|x) − β/|y_l| log π_θ(y_l|x) − γ )

    Log-probs averaged over completion tokens. γ convention: γ is the *absolute* target margin in
    reward units, subtracted after scaling by β (as eq. 6; TRL's `simpo_gamma` is the same γ; the
    paper's tables report γ/β). Reference arguments are ignored (may be None).
    """
    cr = beta * policy_chosen_logps / chosen_lengths
    rr = beta * policy_rejected_logps / rejected_lengths
    losses = -F.logsigmoid(cr - rr - gamma)
    return losses, _rewards_stats(cr, rr)


def rpo(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    beta: float = 0.1,
    alpha: float = 1.0,
) -> tuple[Tensor, dict]:
    """DPO + NLL (Iterative RPO) — Pang et al. 2024, arXiv 2404.19733, eq. 1:

        L = −log σ(β h) + α · (−log π_θ(y_w|x) / |y_w|)

    The DPO term uses summed log-probs; the NLL term is length-averaged (the paper's
    normalisation). The NLL term keeps the chosen likelihood from falling, which plain DPO allows
    (both log-probs can drop as long as the margin grows). Stat: `nll_loss`.
    """
    dpo_losses, stats = dpo(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=beta
    )
    nll = -policy_chosen_logps / chosen_lengths
    stats["nll_loss"] = nll.detach()
    return dpo_losses + alpha * nll, stats


def log1mexp(x: Tensor) -> Tensor:
    """log(1 − eˣ) for x ≤ 0, accurate near 0 and for x ≪ 0 (Mächler 2012, "Accurately computing
    log(1 − exp(−|a|))"): log(−expm1(x)) for x > −log 2, log1p(−eˣ) otherwise.

    x is clamped to ≤ −1e-30 so a probability of exactly 1 gives a large finite value, not −inf.
    """
    x = x.clamp(max=-1e-30)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    *,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    lam: float = 0.1,
) -> tuple[Tensor, dict]:
    """ORPO — Hong et al. 2024, arXiv 2403.07691, §4 (eqs. 6–7). No reference model:

        P̄(y|x) = exp(log π_θ(y|x) / |y|)         (length-averaged log-prob, eq. 4's note)
        log odds(y|x) = log P̄ − log(1 − P̄)        (computed with `log1mexp`)
        L_OR = −log σ(log odds(y_w|x) − log odds(y_l|x))
        L = L_SFT + λ L_OR,   L_SFT = −log π_θ(y_w|x) / |y_w|

    Log-probs averaged over completion tokens. Departure from TRL: L_SFT is the per-sequence mean
    NLL of y_w (then averaged over pairs), TRL averages NLL over all chosen tokens of the batch.
    Stats: `sft_loss`, `or_loss`, `log_odds_ratio`; rewards are λ·(average log-prob), as TRL.
    """
    ac = policy_chosen_logps / chosen_lengths
    ar = policy_rejected_logps / rejected_lengths
    log_odds = (ac - log1mexp(ac)) - (ar - log1mexp(ar))
    or_loss = -F.logsigmoid(log_odds)
    sft_loss = -ac
    losses = sft_loss + lam * or_loss
    return losses, _rewards_stats(
        lam * ac, lam * ar, sft_loss=sft_loss, or_loss=or_loss, log_odds_ratio=log_odds
    )


def apo_zero(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
) -> tuple[Tensor, dict]:
    """APO-zero — D'Oosterlinck et al. 2024, arXiv 2408.06266, §3 (use when y_w is better than
    the model's own outputs): push chosen likelihood up and rejected down, independently:

        L = (1 − σ(β Δ_w)) + σ(β Δ_l),   Δ = log π_θ(y|x) − log π_ref(y|x)

    Summed log-probs.
    """
    cl, rl = _logratios(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    losses = (1 - torch.sigmoid(beta * cl)) + torch.sigmoid(beta * rl)
    return losses, _rewards_stats(beta * cl, beta * rl)


def apo_down(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
) -> tuple[Tensor, dict]:
    """APO-down — D'Oosterlinck et al. 2024, arXiv 2408.06266, §3 (use when the model is better
    than y_w): both likelihoods go down, the rejected one faster:

        L = σ(β Δ_w) + (1 − σ(β (Δ_w − Δ_l)))

    Summed log-probs.
    """
    cl, rl = _logratios(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    losses = torch.sigmoid(beta * cl) + (1 - torch.sigmoid(beta * (cl - rl)))
    return losses, _rewards_stats(beta * cl, beta * rl)


def kto(
    policy_logps: Tensor,  # (B,) summed log π_θ(y|x) of the labelled completions
    ref_logps: Tensor,  # (B,)
    desirable: Tensor,  # (B,) bool
    policy_kl_logps: Tensor,  # (M,) summed log π_θ(y'|x) of mismatched pairs (x, y')
    ref_kl_logps: Tensor,  # (M,)
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, dict]:
    """KTO — Ethayarajh et al. 2024, arXiv 2402.01306, §4 (the KTO loss; z₀ as in §4.1):

        r(x, y) = log π_θ(y|x) − log π_ref(y|x)
        z₀ = max(0, mean over mismatched pairs (x_i, y_j), j ≠ i, of r(x_i, y_j))   (no gradient)
        v(x, y) = λ_D σ(β (r − z₀))  if y is desirable,   λ_U σ(β (z₀ − r))  if undesirable
        L(x, y) = λ_y − v(x, y)

    Summed log-probs. z₀ is the paper's estimate of KL(π_θ ‖ π_ref) from completions of other
    prompts in the batch, clamped at 0 and detached. λ_D = `desirable_weight`, λ_U =
    `undesirable_weight`; the paper advises λ_D n_D / (λ_U n_U) ∈ [1, 4/3].
    Stats (B,): `reward` β r, `desirable`, and the scalar `kl` (z₀ before the clamp: `kl_raw`).
    """
    r = policy_logps - ref_logps
    kl_raw = (policy_kl_logps - ref_kl_logps).mean().detach()
    z0 = kl_raw.clamp(min=0)
    d = desirable.to(torch.bool)
    v = torch.where(
        d,
        desirable_weight * torch.sigmoid(beta * (r - z0)),
        undesirable_weight * torch.sigmoid(beta * (z0 - r)),
    )
    lam = torch.where(
        d, torch.full_like(r, desirable_weight), torch.full_like(r, undesirable_weight)
    )
    losses = lam - v
    stats = {
        "reward": (beta * r).detach(),
        "desirable": d.to(r.dtype),
        "kl": z0,
        "kl_raw": kl_raw,
    }
    return losses, stats


@dataclass(frozen=True)
class PreferenceLoss:
    """A registered preference loss: its function and what the trainer must give it, declared
    here (the trainer and the config read these fields; nothing is inferred from the signature).

    - `fn`: the loss, with the paired signature of this module's docstring (`unpaired`: kto's).
    - `reference_free`: it never reads reference log-probs: the trainer skips the reference pass
      and passes None, and the held-out margin is the length-averaged log-prob margin.
    - `unpaired`: it trains on labelled completions with mismatched pairs (KTO), not on pairs.
    - `lengths`: it takes the completion lengths `chosen_lengths` / `rejected_lengths` (B,),
      supplied by the trainer (so they are no `loss.args`).

    Calling it calls `fn`.
    """

    fn: Callable[..., tuple[Tensor, dict]]
    reference_free: bool = False
    unpaired: bool = False
    lengths: bool = False

    def __call__(self, *args, **kwargs) -> tuple[Tensor, dict]:
        """`fn(*args, **kwargs)`: (losses (B,), stats)."""
        return self.fn(*args, **kwargs)

    @property
    def trainer_args(self) -> set[str]:
        """Keyword arguments of `fn` that the trainer supplies (not valid in `loss.args`)."""
        return {"chosen_lengths", "rejected_lengths"} if self.lengths else set()


#: The valid values of `loss.name`: paired losses and KTO (unpaired), with what each needs.
#: (hinge accepts None references but is not reference-free: the trainer gives it π_ref.)
PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {
    "dpo": PreferenceLoss(dpo),
    "cdpo": PreferenceLoss(cdpo),
    "ipo": PreferenceLoss(ipo),
    "hinge": PreferenceLoss(hinge),
    "dpo_norm": PreferenceLoss(dpo_norm, lengths=True),
    "simpo": PreferenceLoss(simpo, reference_free=True, lengths=True),
    "orpo": PreferenceLoss(orpo, reference_free=True, lengths=True),
    "apo_zero": PreferenceLoss(apo_zero),
    "apo_down": PreferenceLoss(apo_down),
    "rpo": PreferenceLoss(rpo, lengths=True),
    "kto": PreferenceLoss(kto, unpaired=True),
}

#: The field's usual names where ours differ → ours, for `loss.name` (the run's config records
#: ours). TRL's `DPOConfig.loss_type`: "sigmoid" is DPO (eq. 7 on summed log-probs, as `dpo`);
#: "sigmoid_norm" is DPO on length-averaged reference log-ratios, −log σ(β (Δ_w/|y_w| −
#: Δ_l/|y_l|)), as `dpo_norm`. TRL's "hinge", "ipo", "apo_zero", "apo_down" (and CPO's "simpo")
#: are our names already (TRL's "ipo" averages log-probs over tokens, ours sums: see `ipo`).
#: Not aliases: TRL's "robust" is robust DPO (Chowdhury et al. 2024, arXiv 2403.00409), not
#: `cdpo` (TRL before v0.29 gave cDPO as "sigmoid" with label_smoothing; since its DPO refactor
#: "sigmoid" ignores label_smoothing and TRL has no cDPO); "exo_pair", "nca_pair", "bco_pair",
#: "sppo_hard", "aot", "aot_unpaired", "discopop" and "sft" are not implemented here.
PREFERENCE_ALIASES: dict[str, str] = {"sigmoid": "dpo", "sigmoid_norm": "dpo_norm"}


def unpaired_loss_names() -> str:
    """The names of the unpaired losses, for messages: "'kto'" ("'a' or 'b'" if several)."""
    return " or ".join(f"'{n}'" for n, loss in PREFERENCE_LOSSES.items() if loss.unpaired)

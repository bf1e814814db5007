"""Value-model (critic) loss and diagnostics for PPO with GAE."""

import torch
from torch import Tensor

from rlhflab.ops import masked_var

__all__ = ["clipped_value_loss", "explained_variance"]


def _check_same(name: str, x: Tensor, ref: Tensor) -> None:
    if x.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected values' {tuple(ref.shape)}")


def clipped_value_loss(
    values: Tensor, values_old: Tensor, returns: Tensor, mask: Tensor, *, clip_range: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: 0.5·max((V − R)², (clip(V, V_old − c, V_old + c) − R)²) per token.

    V = values (new critic, carries the gradient), V_old = values_old (critic at rollout time),
    R = returns (GAE λ-returns, targets), c = clip_range. The max makes the loss pessimistic: a value
    prediction that moved more than c from V_old gets no gradient when moving it further helps.
    stats["clipped"] = 1.0 where the clipped branch is strictly larger, i.e. where the clip zeroes
    the gradient (TRL's vf_clipfrac convention).
    Shapes: values, values_old, returns, mask (B, T). Returns loss (B, T) in values' dtype, 0 at
    padding, and stats {"clipped": (B, T) float, detached}. Reduce with losses.aggregate.
    Source: not in the PPO paper (arXiv 1707.06347); from OpenAI baselines' ppo2 and
    lm-human-preferences (Ziegler et al. 2019, arXiv 1909.08593), analysed as "value function
    clipping" by Engstrom et al. 2020, "Implementation Matters in Deep Policy Gradients", arXiv
    2005.12729, §3.
    Raises: ValueError on mismatched shapes or clip_range <= 0.
    """
    if not clip_range > 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range}")
    for name, x in (("values_old", values_old), ("returns", returns), ("mask", mask)):
        _check_same(name, x, values)
    m = mask.bool()
    v = torch.where(m, values, 0.0)
    v_old = torch.where(m, values_old.detach(), 0.0)
    r = torch.where(m, returns.detach(), 0.0)
    v_clipped = v_old + torch.clamp(v - v_old, -clip_range, clip_range)
    unclipped_sq = (v - r) ** 2
    clipped_sq = (v_clipped - r) ** 2
    loss = torch.where(m, 0.5 * torch.maximum(unclipped_sq, clipped_sq), 0.0)
    clipped = (m & (clipped_sq > unclipped_sq)).to(loss.dtype).detach()
    return loss, {"clipped": clipped}


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """Explained variance of the critic: 1 − Var(R − V) / Var(R) over the valid tokens.

    1 is a perfect critic, 0 is no better than predicting the mean return, < 0 is worse. Population
    variances (ops.masked_var) over every masked element; NaN when Var(R) = 0 (undefined, as in
    Stable-Baselines3 / cleanrl). A diagnostic: computed without gradient.
    Shapes: values, returns, mask (B, T) (or any equal shapes). Returns a 0-d tensor in values' dtype.
    Source: the `explained_variance` diagnostic of OpenAI baselines, logged by PPO implementations.
    Raises: ValueError on mismatched shapes.
    """
    _check_same("returns", returns, values)
    _check_same("mask", mask, values)
    var_r = masked_var(returns, mask)
    var_res = masked_var(returns - values, mask)
    nan = torch.full_like(var_r, float("nan"))
    return torch.where(var_r > 0, 1.0 - var_res / torch.where(var_r > 0, var_r, 1.0), nan)

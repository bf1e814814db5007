"""Multi-turn trajectories as rollouts: the turns after the opening prompt, concatenated as token
ids, with a loss mask that is 1 only on the model's own tokens.

A `Trajectory` is a `Rollout` whose completion holds every token after the opening prompt —
the model's turns (as sampled, stop token included) and the environment's messages between them
(tool results, user replies; the chat template's headers included) — so that one forward over
[prompt; completion] scores every model token in exactly the context it was sampled in. `mask`
(the loss and advantage mask) is 1 on model tokens only; `attend` (the attention mask of the
completion part) is 1 on every real token. `completion_logps`, the PG phases and every loss read
`mask`; the forward reads `attention_mask`, which here uses `attend`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhflab.rollout.sampler import Rollout, left_pad

__all__ = ["Trajectory", "pack_trajectories"]


@dataclass
class Trajectory(Rollout):
    """A `Rollout` with interior tokens that are attended but carry no loss.

    Attributes (besides Rollout's):
        attend: (B, T) long, 1 on every real completion token (model and environment), 0 on
            right padding. `mask` <= `attend` everywhere.
    """

    attend: Tensor | None = None

    @property
    def attention_mask(self) -> Tensor:
        """(B, P+T) long: the prompt's mask, then `attend` (every real trajectory token, model's
        and environment's), unlike `mask`, which is the model's tokens only."""
        return torch.cat([self.prompt_mask, self.attend.long()], dim=1)

    def to(self, device: torch.device | str) -> Trajectory:
        """The same trajectories with every tensor on `device`."""
        return Trajectory(
            self.prompt_ids.to(device), self.prompt_mask.to(device),
            self.completion_ids.to(device), self.mask.to(device), self.logp.to(device),
            self.truncated.to(device), self.attend.to(device),
        )  # fmt: skip

    def trimmed(self) -> Trajectory:
        """`Rollout.trimmed` with `attend` cut to the same columns (the environment's tokens
        before the last scored one stay attended)."""
        base = Rollout.trimmed(self)
        if base is self:
            return self
        return Trajectory(
            base.prompt_ids, base.prompt_mask, base.completion_ids, base.mask, base.logp,
            base.truncated, self.attend[:, : base.completion_ids.size(1)],
        )  # fmt: skip

    def select(self, index: Tensor | slice) -> Trajectory:
        """Rows `index` of every field (a micro-batch view)."""
        base = Rollout.select(self, index)
        return Trajectory(
            base.prompt_ids, base.prompt_mask, base.completion_ids, base.mask, base.logp,
            base.truncated, self.attend[index],
        )  # fmt: skip


def pack_trajectories(
    prompts: list[list[int]],
    tokens: list[list[int]],
    is_model: list[list[int]],
    logps: list[list[float]],
    truncated: list[bool],
    pad_token_id: int,
) -> Trajectory:
    """A `Trajectory` from per-episode lists: opening prompt ids (left-padded), the ids after it
    (right-padded), 0/1 flags of which ids the model sampled (the loss mask), the sampler
    log-probs of those ids (0 elsewhere) and whether each episode was cut by a limit.

    Raises ValueError when the lists disagree in length."""
    n = len(prompts)
    if not (len(tokens) == len(is_model) == len(logps) == len(truncated) == n):
        raise ValueError("pack_trajectories: the per-episode lists differ in length")
    for t, m, lp in zip(tokens, is_model, logps, strict=True):
        if not (len(t) == len(m) == len(lp)):
            raise ValueError("pack_trajectories: tokens, flags and log-probs differ in length")
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)
    width = max(1, max(len(t) for t in tokens))
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.float32)
    logp = torch.zeros((n, width), dtype=torch.float32)
    attend = torch.zeros((n, width), dtype=torch.long)
    for i, (t, m, lp) in enumerate(zip(tokens, is_model, logps, strict=True)):
        ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        mask[i, : len(t)] = torch.tensor(m, dtype=torch.float32)
        logp[i, : len(t)] = torch.tensor(lp, dtype=torch.float32)
        attend[i, : len(t)] = 1
    return Trajectory(
        prompt_ids, prompt_mask, ids, mask, logp, torch.tensor(truncated, dtype=torch.bool), attend
    )

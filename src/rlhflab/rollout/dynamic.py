"""Scored rollout batches and DAPO's dynamic sampling (keep drawing until the groups all vary).

A `ScoredBatch` is a rollout with its rewards and everything the trainer logs per completion,
laid out group-contiguous (the G completions of a prompt are adjacent rows).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlhflab.errors import DataError
from rlhflab.rollout.sampler import Rollout
from rlhflab.rollout.trajectory import Trajectory

__all__ = ["ScoredBatch", "concat_rollouts", "dynamic_sample", "varied_groups"]


def concat_rollouts(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """Stack rollouts row-wise: prompts re-left-padded and completions re-right-padded to the
    widest. Padding positions are masked, so log-probs of real tokens do not change. Multi-turn
    `Trajectory` rollouts stay trajectories (their `attend` mask padded with 0)."""
    p = max(r.prompt_ids.size(1) for r in rollouts)
    t = max(r.completion_ids.size(1) for r in rollouts)

    def left(x: Tensor, width: int, value) -> Tensor:
        return torch.nn.functional.pad(x, (width - x.size(1), 0), value=value)

    def right(x: Tensor, width: int, value) -> Tensor:
        return torch.nn.functional.pad(x, (0, width - x.size(1)), value=value)

    fields = dict(
        prompt_ids=torch.cat([left(r.prompt_ids, p, pad_token_id) for r in rollouts]),
        prompt_mask=torch.cat([left(r.prompt_mask, p, 0) for r in rollouts]),
        completion_ids=torch.cat([right(r.completion_ids, t, pad_token_id) for r in rollouts]),
        mask=torch.cat([right(r.mask, t, 0.0) for r in rollouts]),
        logp=torch.cat([right(r.logp, t, 0.0) for r in rollouts]),
        truncated=torch.cat([r.truncated for r in rollouts]),
    )
    if all(isinstance(r, Trajectory) for r in rollouts):  # multi-turn: the attended tokens too
        return Trajectory(**fields, attend=torch.cat([right(r.attend, t, 0) for r in rollouts]))
    return Rollout(**fields)


@dataclass
class ScoredBatch:
    """Completions with their rewards. rewards (B,) is the sum of weighted components; components
    holds each component's unweighted (B,) values; texts / problems are row-aligned lists.
    With dense-credit components (a PRM's per-step rewards, `rlhflab.rewards.shaping.
    dense_step_rewards`), rewards is the sequence-level part only and step_rewards (B, T)
    (weighted, 0 off the steps) and steps (B, T) bool hold the rest, aligned with
    rollout.completion_ids; both None otherwise."""

    rollout: Rollout
    rewards: Tensor
    components: dict[str, Tensor]
    texts: list[str]
    problems: list
    info: dict[str, float] = field(default_factory=dict)
    step_rewards: Tensor | None = None
    steps: Tensor | None = None

    def select_groups(self, groups: Tensor, group_size: int) -> ScoredBatch:
        """The rows of the given group indices (n,), kept group-contiguous."""
        rows = (groups[:, None] * group_size + torch.arange(group_size)).reshape(-1)
        idx = rows.tolist()
        return ScoredBatch(
            self.rollout.select(rows.to(self.rollout.mask.device)),
            self.rewards[rows.to(self.rewards.device)],
            {k: v[rows.to(v.device)] for k, v in self.components.items()},
            [self.texts[i] for i in idx],
            [self.problems[i] for i in idx],
            dict(self.info),
            *(None if x is None else x[rows.to(x.device)] for x in (self.step_rewards, self.steps)),
        )

    @staticmethod
    def gather(local: ScoredBatch | None, pad_token_id: int, device, group=None) -> ScoredBatch:
        """The global batch from every data-parallel rank's scored share (None: a rank with no
        rows), concatenated in rank order with `concat`'s padding; `local` itself with one
        process. Every rank must call it; `group` is the collective's group (a background
        thread's `distributed.side_group()`; default the run's)."""
        from rlhflab import distributed

        if distributed.world_size() == 1:
            return local
        parts = distributed.all_gather_object(
            local.to("cpu") if local is not None else None, group=group
        )
        batch = ScoredBatch.concat([b for b in parts if b is not None], pad_token_id)
        return batch.to(device)

    def to(self, device) -> ScoredBatch:
        """The same batch with every tensor on `device`."""
        return ScoredBatch(
            self.rollout.to(device),
            self.rewards.to(device),
            {k: v.to(device) for k, v in self.components.items()},
            self.texts,
            self.problems,
            dict(self.info),
            *(None if x is None else x.to(device) for x in (self.step_rewards, self.steps)),
        )

    @staticmethod
    def concat(batches: list[ScoredBatch], pad_token_id: int) -> ScoredBatch:
        """The batches' rows one after another (rollouts re-padded by `concat_rollouts`;
        rewards (B,), components {name: (B,)}, texts and problems concatenated in order;
        step_rewards and steps re-right-padded with 0 / False). One batch is returned as is."""
        if len(batches) == 1:
            return batches[0]
        width = max(b.rollout.completion_ids.size(1) for b in batches)

        def dense(name: str) -> Tensor | None:
            parts = [getattr(b, name) for b in batches]
            if all(p is None for p in parts):
                return None
            if any(p is None for p in parts):
                raise ValueError(f"ScoredBatch.concat: some batches have {name}, others not")
            return torch.cat([torch.nn.functional.pad(p, (0, width - p.size(1))) for p in parts])

        return ScoredBatch(
            concat_rollouts([b.rollout for b in batches], pad_token_id),
            torch.cat([b.rewards for b in batches]),
            {k: torch.cat([b.components[k] for b in batches]) for k in batches[0].components},
            [t for b in batches for t in b.texts],
            [p for b in batches for p in b.problems],
            dict(batches[0].info),
            dense("step_rewards"),
            dense("steps"),
        )


def varied_groups(rewards: Tensor, group_size: int) -> Tensor:
    """(n_groups,) bool: True where the group's rewards are not all equal (std > 0).

    Shapes: rewards (B,), B = n_groups·group_size, group-contiguous.
    """
    r = rewards.reshape(-1, group_size)
    return (r != r[:, :1]).any(dim=1)


def dynamic_sample(
    prompt_source: Iterator[int],
    draw: Callable[[list[int]], ScoredBatch],
    *,
    n_groups: int,
    group_size: int,
    pad_token_id: int,
) -> tuple[ScoredBatch, dict[str, float]]:
    """DAPO dynamic sampling: draw rounds of `n_groups` prompts until `n_groups` groups with
    non-zero reward variance are collected; return exactly those groups (extra ones dropped).

    `draw(prompt_indices)` samples `group_size` completions per prompt and scores them. Each round
    takes up to `n_groups` prompts from `prompt_source`; the trainer bounds the source (e.g.
    `rollout.dynamic_sampling.max_rounds` rounds of prompts), so a task the model always solves or
    always fails cannot loop forever.
    Returns (batch, stats) with stats "rounds", "prompts_drawn" and "zero_std_group_frac" (over all
    drawn groups).
    Source: Yu et al. 2025, DAPO, arXiv 2503.14476, §3.2 ("over-sample and filter out prompts with
    accuracy equal to 1 and 0"), Algorithm 1. Departure: a round draws `n_groups` prompts (DAPO
    over-samples a larger generation batch); the filter is "rewards not all equal", which is the
    paper's accuracy filter for binary rewards and also covers shaped rewards.
    Raises: DataError when the prompt source is exhausted before the batch is full.
    """
    kept: list[ScoredBatch] = []
    n_kept = rounds = drawn = zero = 0
    while n_kept < n_groups:
        chosen = [i for _, i in zip(range(n_groups), prompt_source, strict=False)]
        if not chosen:
            raise DataError(
                f"dynamic sampling: the prompt source is exhausted after {drawn} prompts in "
                f"{rounds} rounds, with only {n_kept}/{n_groups} groups of non-zero reward "
                "variance (raise rollout.dynamic_sampling.max_rounds, or the model solves all or "
                "none of these prompts)"
            )
        batch = draw(chosen)
        rounds, drawn = rounds + 1, drawn + len(chosen)
        varied = varied_groups(batch.rewards, group_size)
        zero += int((~varied).sum())
        take = varied.nonzero().squeeze(-1)[: n_groups - n_kept].cpu()
        if take.numel():
            kept.append(batch.select_groups(take, group_size))
            n_kept += take.numel()
    stats = {"rounds": rounds, "prompts_drawn": drawn, "zero_std_group_frac": zero / drawn}
    return ScoredBatch.concat(kept, pad_token_id), stats

"""How a sampled batch is scored: the scorer protocol of `rlhflab.experience`.

Two kinds, kept apart on purpose:
- `RewardComponents`: the policy-gradient reward, Σ weight·component over `reward.components`
  (verifier correctness, format, length, overlong, reward models, reward functions), each
  component returned on its own (`rlhflab.rewards.shaping.score_components`).
- `VerifierOnly`: the task verifier's score and nothing else (distillation logs it as
  `rollout/accuracy`; it never enters a loss), 0 for every row of a prompt dataset.

Both count the verifier's errors on the verifier they hold (`scorer.verifier.n_errors`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from rlhflab.rewards.shaping import score_components

__all__ = ["RewardComponents", "Scorer", "VerifierOnly"]


class Scorer(Protocol):
    """What the sampler needs to score a rollout."""

    verifier: object  # a `rlhflab.rewards.verifier.Verifier` (its `n_errors` is logged)

    def score(self, texts: list[str], rollout, problems: list, *, where: str,
              raw_scores: bool = False,
              dense: list | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
        """(rewards (B,) float32, {component: (B,) float32}) of row-aligned `texts` (decoded
        completions of `rollout`) and `problems` (their rows); `where` names the batch in
        errors ("step 3"). `raw_scores`: measuring, not training (reward models unnormalised,
        their running statistics untouched). `dense`: a list that receives the weighted
        `StepRewards` of dense-credit components (`score_components`); None refuses them."""
        ...

    def idle(self, device) -> None:
        """Called on a data-parallel rank with no rows this round, in place of `score`: take
        part in whatever the other ranks' scoring does collectively."""
        ...


class RewardComponents:
    """The policy-gradient reward of `reward.components` (module doc).

    Args:
        components: `RewardComponentConfig`s.
        verifier: the task's `Verifier` (the `correctness` component scores with it).
        max_new_tokens: the rollout's budget (length and overlong components read it).
        parallel: the run's `parallel` section (sharded reward models load by it).
        vllm: the run's `rollout.vllm` section (a judge's own vLLM engine starts with it).
    """

    def __init__(self, components, verifier, *, max_new_tokens: int, parallel=None,
                 vllm=None) -> None:  # fmt: skip
        self.components, self.verifier = components, verifier
        self.max_new_tokens, self.parallel, self.vllm = max_new_tokens, parallel, vllm

    def score(self, texts, rollout, problems, *, where, raw_scores=False, dense=None):
        return score_components(
            self.components,
            {
                "raw_scores": raw_scores,
                "texts": texts,
                "problems": problems,
                "verifier": self.verifier,
                "lengths": rollout.lengths.cpu(),
                "truncated": rollout.truncated.cpu(),
                "max_new_tokens": self.max_new_tokens,
                "rollout": rollout,
                "parallel": self.parallel,
                "vllm": self.vllm,
            },
            where=where,
            dense=dense,
        )

    def idle(self, device) -> None:
        from rlhflab.rewards.reward_model import take_part_without_rows

        take_part_without_rows(self.components, self.parallel, device)


class VerifierOnly:
    """The task verifier's score of every row (`score_batch`), or 0 for every row when the rows
    are a prompt dataset's (`is_task` False: no verifier applies); one component,
    "correctness"."""

    def __init__(self, verifier, *, is_task: bool = True) -> None:
        self.verifier, self.is_task = verifier, is_task

    def score(self, texts, rollout, problems, *, where, raw_scores=False, dense=None):
        scores = self.verifier.score_batch(texts, problems) if self.is_task else [0.0] * len(texts)
        rewards = torch.tensor(scores, dtype=torch.float32)
        return rewards, {"correctness": rewards}

    def idle(self, device) -> None:
        return None

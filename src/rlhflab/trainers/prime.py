"""PRIME's online implicit process reward model, as the policy-gradient trainer uses it (`prime:`).

Cui et al. 2025, "Process Reinforcement through Implicit Rewards", arXiv 2502.01456, Algorithm 1
and the PRIME code (training/verl/workers/actor/dp_prime.py, `update_policy`): on each batch of
rollouts, with outcome labels r_o from the verifier,
    1. score   r_φ(y_t) = β·log π_φ(y_t|y_<t)/π_ref(y_t|y_<t) at every completion token
               (`losses.reward_model.implicit_process_rewards`), with the PRM *before* this
               batch's update (the code's default `update: after`: rewards from the same forward
               as the loss, then the optimizer step);
    2. update  one optimizer step of π_φ on L_CE = mean_i BCE(σ(Σ_t r_φ(y_i,t)), r_o,i)
               (`losses.reward_model.implicit_prm_ce`), with its own AdamW and LR schedule;
    3. reward  coef·r_φ(y_t) enters the batch as dense (per-token) rewards at every token, beside
               the outcome: the same seam as a PRM's `credit: dense` (`ScoredBatch.step_rewards`,
               read by `pg_phases.reward_signal`), so any per-token advantage takes it
               (`prime_rloo`: PRIME's RLOO per reward type; `process_group_zscore`; `gae`).
π_φ is a copy of the initial policy (the paper: "initialized from the SFT model"; its code uses the
same checkpoint for π_φ and π_ref); π_ref is the frozen initial policy: the trainer's reference
when it has one (kl.coef > 0), else a frozen copy of its own. Log-probs at rollout.temperature,
as the policy's. The PRM, its optimizer and schedule are checkpointed with the run
(`checkpointed()`: "prime_model", "prime_optimizer", "prime_scheduler") and saved at the end in
HF format (`prime_model/`).

Departures, stated: one PRM optimizer step per batch (the code splits the batch into its
reward_model mini-batches, each a step, with rewards of each mini-batch from the PRM before that
mini-batch's step: the same with one mini-batch); no `update: before` (re-scoring after the
update), no `prime_granularity: whole` and no `prime_norm: batch_norm` option; the reward is
β-scaled as the paper writes it (the code passes the unscaled log-ratio; `coef: 1/β` gives it);
the CE is computed from logits (log σ stable; the code's BCE clamps log at −100). The policy
update and the PRM update use the same batch, as in the code.
"""

from __future__ import annotations

import copy

import torch

from rlhflab import distributed
from rlhflab.losses.reward_model import (
    implicit_prm_ce,
    implicit_prm_pair_accuracy,
    implicit_process_rewards,
)
from rlhflab.rewards.shaping import correctness_of
from rlhflab.rollout.sampler import completion_logps
from rlhflab.trainers.common import (
    Reference,
    grad_norm_and_clip,
    make_optimizer,
    make_scheduler,
    micro_batches,
    save_final_model,
)


class ImplicitPRM:
    """π_φ with its optimizer and LR schedule, and π_ref. Build it before the policy is wrapped
    (`distributed.wrap`) or trained: π_φ is a copy of `policy`, placed and sharded like it (as
    `common.Reference` copies it: under FSDP2 over several processes a meta copy filled from
    rank 0's weights), trained in full. (A LoRA policy is refused at config load.)

    `reference`: the trainer's π_ref (the initial policy) or None (a frozen copy is made)."""

    def __init__(self, policy: torch.nn.Module, cfg, reference: Reference | None,
                 total_steps: int) -> None:  # fmt: skip
        self.cfg, self.pcfg = cfg, cfg.prime
        self.reference = reference if reference is not None else Reference(policy, cfg.parallel)
        if distributed.loads_from_rank0():
            model = distributed.meta_copy(policy).train().requires_grad_(True)
            weights = distributed.host_state(policy) if distributed.is_main() else None
            self.model = distributed.wrap(model, cfg.parallel, weights=weights)
        else:
            model = copy.deepcopy(policy).train().requires_grad_(True)
            self.model = distributed.wrap(model, cfg.parallel)
        self.optimizer = make_optimizer(self.model, self.pcfg.optim)
        self.scheduler = make_scheduler(self.optimizer, self.pcfg.optim, total_steps)

    def step(self, data, autocast_dtype, guard, step: int) -> dict:
        """Phases 1-3 on this rank's share `data.local` (a `pg_phases.StepData`): sets
        `data.local.step_rewards` (B_local, T) = coef·r_φ(y_t) (added to any dense rewards
        already there) and `data.local.steps` = every completion token, then updates π_φ.
        Returns metrics: prime/loss (L_CE of the batch, before the update), prime/accuracy
        (PRIME's pairwise accuracy of r_φ(y) within groups, `implicit_prm_pair_accuracy`, before
        the update), prime/classify_acc ((r_φ(y) > 0) == r_o), prime/score_mean (mean r_φ(y)),
        prime/grad_norm, prime/lr.

        Raises: ValueError when the batch has no correctness component (outcome labels)."""
        cfg, pcfg, local = self.cfg, self.pcfg, data.local
        rollout = local.rollout
        labels = correctness_of(local.components)
        if labels is None:
            raise ValueError("prime: the batch has no correctness component (outcome labels)")
        labels = labels.to(rollout.mask.device).double()
        global_b = data.batch.rollout.mask.size(0)  # the loss is the mean over the global batch
        n, width = rollout.mask.shape
        rewards = torch.zeros(n, width, dtype=torch.float32, device=rollout.mask.device)
        scores = torch.zeros(n, dtype=torch.float64)
        sums = {"loss": 0.0, "correct": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        for rows_list, weight in micro_batches(cfg.train, list(range(n)), rollout.widths(),
                                               pad_row=0):  # fmt: skip
            rows = torch.tensor(rows_list, dtype=torch.long, device=rollout.mask.device)
            micro = rollout.select(rows)
            with torch.no_grad(), self.reference.scoring() as ref_model:
                logp_ref, _ = completion_logps(ref_model, micro, temperature=cfg.rollout.temperature,
                                               autocast_dtype=autocast_dtype)  # fmt: skip
            logp, _ = completion_logps(self.model, micro, temperature=cfg.rollout.temperature,
                                       autocast_dtype=autocast_dtype)  # fmt: skip
            losses, stats = implicit_prm_ce(logp, logp_ref, micro.mask, labels[rows],
                                            beta=pcfg.beta)  # fmt: skip
            (losses.sum() / global_b * weight).backward()
            if weight:
                r_tok = implicit_process_rewards(logp.detach(), logp_ref, micro.mask,
                                                 beta=pcfg.beta)  # fmt: skip
                rewards[rows] = (pcfg.coef * r_tok).float()
                scores[rows.cpu()] = stats["score"].double().cpu()
                sums["loss"] += float(losses.detach().sum())
                sums["correct"] += float(stats["correct"].sum())
        sums = distributed.sum_dict(sums)
        grad_norm = grad_norm_and_clip(self.model, pcfg.optim.max_grad_norm)
        loss = sums["loss"] / global_b
        if guard.check(step, {"prime/loss": loss, "prime/grad_norm": grad_norm}):
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        mask = rollout.mask.bool()
        old_r = local.step_rewards if local.step_rewards is not None else 0.0
        old_s = local.steps if local.steps is not None else torch.zeros_like(mask)
        local.step_rewards = torch.where(mask, rewards + old_r, 0.0)
        local.steps = old_s.bool() | mask
        all_scores = distributed.gather_cat(scores.to(rollout.mask.device))
        all_labels = distributed.gather_cat(labels)
        metrics = {
            "prime/loss": loss,
            "prime/classify_acc": sums["correct"] / global_b,
            "prime/score_mean": all_scores.mean().item(),
            "prime/grad_norm": float(grad_norm),
            "prime/lr": self.scheduler.get_last_lr()[0],
        }
        if cfg.rollout.group_size >= 2:  # pairs within a group
            metrics["prime/accuracy"] = implicit_prm_pair_accuracy(
                all_scores.cpu(), all_labels.cpu(), group_size=cfg.rollout.group_size
            ).item()
        return metrics

    def save(self, tokenizer, path) -> None:
        """π_φ in HF format at `path` (every rank calls it; rank 0 writes)."""
        save_final_model(self.model, tokenizer, path)

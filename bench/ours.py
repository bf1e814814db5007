"""rlhflab's training steps, assembled from the building blocks in the order the trainers run them.

Each `step()` below is the body of one iteration of the trainer's step loop, with the trainer's
own functions where they are module-level (imported from `rlhflab.trainers.*`), and the same
tensors, denominators, metric reductions and host syncs. Left out: the tracker / jsonl writing,
the samples file and held-out evaluation, which run outside the step's `perf/step_s` in the
trainers too (apart from logging, which is a few dict writes).
"""

from __future__ import annotations

import copy
import itertools
import time
from types import SimpleNamespace

import torch

from rlhflab.data.formatting import encode_prompt
from rlhflab.losses.advantages import group_zscore
from rlhflab.losses.aggregate import aggregate
from rlhflab.losses.kl import kl_penalty
from rlhflab.losses.policy import ppo_clip
from rlhflab.losses.preference import dpo
from rlhflab.rollout.dynamic import ScoredBatch
from rlhflab.rollout.engines import SamplingParams, make_engine
from rlhflab.rollout.sampler import completion_logps, decode_completions
from rlhflab.trainers.common import grad_norm_and_clip, make_optimizer, make_scheduler
from rlhflab.trainers.direct_alignment import sequence_logps
from rlhflab.trainers.policy_gradient import (
    _accumulate,
    _accumulate_update,
    _no_grad_logps,
    _rollout_metrics,
    _update_metrics,
)


def optim_cfg(lr: float):
    from rlhflab.config import OptimConfig

    return OptimConfig(lr=lr, warmup_steps=0, schedule="constant", max_grad_norm=1.0)


def set_checkpointing(model, on: bool) -> None:
    """Gradient checkpointing as the trainers set it (`model.gradient_checkpointing`, default off):
    on means non-reentrant activation checkpointing of every layer; off is made explicit here so
    that a model loaded with it on cannot slip into a row that says off."""
    if on:  # the trainers' call (rlhflab.trainers.common)
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    elif model.is_activation_checkpointing:
        model.activation_checkpointing_disable()


def text_reward(texts: list[str], *_ignored) -> list[float]:
    """The benchmarks' reward (both frameworks): the fraction of vowels among a completion's
    letters. Cheap, deterministic and varied, so group advantages are not all zero."""
    out = []
    for t in texts:
        letters = [c for c in t.lower() if c.isalpha()]
        out.append(sum(c in "aeiou" for c in letters) / max(1, len(letters)))
    return out


class GRPOStep:
    """policy_gradient.train's step with the grpo preset: group z-score (Bessel), PPO-clip ε 0.2,
    seq_mean_token_mean, k3 KL in the loss with coefficient `beta` (reference model when > 0),
    update_epochs 1, minibatches 1, one micro-batch of the whole batch, AdamW, grad clip 1.0.
    On the first (here: only) optimizer step logp_old is the detached logp of the same forward.

    Sampling goes through the rollout engine seam as in the trainer (`make_engine` with
    `rollout.engine: hf`, `engine.generate(prompts, SamplingParams(n=group, ...))`, so a group's
    prompt is prefilled once). `fixed_length`: the engine's stop set is replaced by one id that
    never matches (-1), so every completion has `max_new` tokens (TRL: `eos_token_id=None`);
    this one assignment is the bench's only hook into the engine."""

    def __init__(
        self, model, tokenizer, prompts: list[str], *, n_prompts, group, max_new, beta, lr,
        fixed_length=True, reward_fn=text_reward, checkpointing=False,
    ):  # fmt: skip
        set_checkpointing(model, checkpointing)
        self.model, self.tok = model, tokenizer
        self.ids = [encode_prompt(tokenizer, p) for p in prompts]
        self.stream = itertools.cycle(range(len(self.ids)))
        self.n_prompts, self.group, self.max_new, self.beta = n_prompts, group, max_new, beta
        self.ref = copy.deepcopy(model).eval().requires_grad_(False) if beta > 0 else None
        oc = optim_cfg(lr)
        self.opt = make_optimizer(model, oc)
        self.sched = make_scheduler(self.opt, oc, 10**6)
        self.rng = torch.Generator().manual_seed(0)
        self.shuffle = torch.Generator().manual_seed(1)
        self.cfg = SimpleNamespace(
            train=SimpleNamespace(micro_batch_size=n_prompts * group),
            rollout=SimpleNamespace(temperature=1.0),
        )
        # The trainer's call, with rollout.engine "hf", no extra stop ids and no autocast (fp32).
        rollout_cfg = SimpleNamespace(engine="hf", stop_token_ids=(), vllm=None)
        self.engine = make_engine(rollout_cfg, model, tokenizer, autocast_dtype=None)
        if fixed_length:
            self.engine.stop_token_ids = (-1,)  # never matches: no early stop (bench hook)
        self.sampling = SamplingParams(n=group, max_new_tokens=max_new, temperature=1.0)
        self.reward_fn = reward_fn
        self.tokens: list[int] = []
        self.phases: dict[str, list[float]] = {"rollout": [], "ref": [], "update": []}

    def step(self) -> None:
        model, G = self.model, self.group
        B = self.n_prompts * G
        t0 = time.perf_counter()
        chosen = [next(self.stream) for _ in range(self.n_prompts)]
        model.eval()
        self.engine.wake()
        rollout = self.engine.generate(
            [self.ids[i] for i in chosen],
            self.sampling,
            generator=self.rng,
            rows=list(range(B)),  # one process: the global rows are all rows
            n_rows=B,
            width=max(len(self.ids[i]) for i in chosen),
        )
        self.engine.sleep()
        model.train()
        texts = decode_completions(self.tok, rollout, self.engine.stop_token_ids)
        rewards = torch.tensor(self.reward_fn(texts, chosen, G), dtype=torch.float32)
        batch = ScoredBatch(rollout, rewards, {"correctness": rewards}, texts, [None] * B)
        mask = rollout.mask
        t1 = time.perf_counter()
        logp_ref = _no_grad_logps(self.ref, rollout, self.cfg, None) if self.ref else None
        t2 = time.perf_counter()
        adv = group_zscore(rewards, group_size=G, unbiased=True)
        sums, update_sums, loss_total, grad_norms = {}, {}, 0.0, []
        perm = torch.randperm(B, generator=self.shuffle)
        mb_rows = perm
        num_tokens = mask[mb_rows].sum()
        self.opt.zero_grad(set_to_none=True)
        for s in range(0, B, self.cfg.train.micro_batch_size):
            rows = mb_rows[s : s + self.cfg.train.micro_batch_size]
            micro = rollout.select(rows)
            logp, entropy = completion_logps(model, micro, temperature=1.0, with_entropy=True)
            loss_tok, stats = ppo_clip(logp, logp.detach(), adv[rows], micro.mask)
            if logp_ref is not None:
                kl_tok = kl_penalty(logp, logp_ref[rows], "k3")
                loss_tok = loss_tok + self.beta * kl_tok
                stats = {**stats, "kl": kl_tok.detach()}
            loss = aggregate(
                loss_tok, micro.mask, "seq_mean_token_mean", num_tokens=num_tokens, num_seqs=B
            )
            loss.backward()
            loss_total += float(loss.detach())
            _accumulate_update(update_sums, micro.mask, stats)
            _accumulate(sums, micro, stats, entropy, logp.detach())
        grad_norms.append(grad_norm_and_clip(model, 1.0))
        self.opt.step()
        self.sched.step()
        self.engine.update_weights(model.named_parameters())  # "hf": nothing to do
        # Phase 6's reductions (host syncs) as the trainer does them.
        metrics = _rollout_metrics(batch, G)
        n_tok = sums.pop("tokens")
        metrics.update({k: (v / n_tok).item() for k, v in sums.items()})
        metrics.update(_update_metrics(update_sums))
        metrics["optim/grad_norm"] = torch.stack(grad_norms).mean().item()
        metrics["perf/tokens"] = mask.sum().item()
        t3 = time.perf_counter()
        self.tokens.append(int(metrics["perf/tokens"]))
        self.phases["rollout"].append(t1 - t0)
        self.phases["ref"].append(t2 - t1)
        self.phases["update"].append(t3 - t2)


class DPOStep:
    """direct_alignment.train's step for the dpo loss: `batch_size` pairs, chosen and rejected of a
    micro-batch in one forward (`sequence_logps`), cached reference log-probs (the trainer's
    only mode), loss sum / B, per-micro-batch `.item()` of every stat, grad clip 1.0, AdamW."""

    def __init__(
        self, model, rows: list[dict], *, batch_size, micro_batch_size, beta, lr, pad_id,
        checkpointing=False,
    ):  # fmt: skip
        from rlhflab.trainers.direct_alignment import cache_reference

        set_checkpointing(model, checkpointing)
        self.model, self.rows, self.B, self.mb = model, rows, batch_size, micro_batch_size
        self.beta, self.pad = beta, pad_id
        cache_reference(
            model, rows, pad_id, unpaired=False, chunk=2 * micro_batch_size, autocast_dtype=None
        )
        oc = optim_cfg(lr)
        self.opt = make_optimizer(model, oc)
        self.sched = make_scheduler(self.opt, oc, 10**6)
        self.order = itertools.cycle(range(len(rows)))

    def step(self) -> None:
        model, B = self.model, self.B
        batch_idx = [next(self.order) for _ in range(B)]
        self.opt.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        n_tokens = 0
        for s in range(0, B, self.mb):
            mb = [self.rows[i] for i in batch_idx[s : s + self.mb]]
            n = len(mb)
            comps = [r["chosen"] for r in mb] + [r["rejected"] for r in mb]
            logps, lengths = sequence_logps(model, [r["prompt"] for r in mb] * 2, comps, self.pad)
            n_tokens += int(lengths.sum())
            pc, pr = logps[:n], logps[n:]
            rc = torch.tensor([r["ref_chosen"] for r in mb])
            rr = torch.tensor([r["ref_rejected"] for r in mb])
            losses, stats = dpo(pc, pr, rc, rr, beta=self.beta)
            stats = {f"dpo/{k}": v for k, v in stats.items()}
            stats["logps/chosen"] = pc.detach()
            stats["logps/rejected"] = pr.detach()
            loss = losses.sum() / B
            loss.backward()
            sums["train/loss"] = sums.get("train/loss", 0.0) + loss.item()
            for k, val in stats.items():
                sums[k] = sums.get(k, 0.0) + val.float().sum().item() / B
        grad_norm = grad_norm_and_clip(model, 1.0)
        self.opt.step()
        self.sched.step()
        float(grad_norm)


class RMStep:
    """reward_model.train's step for kind "preference", calling the trainer's own `rm_losses`
    (chosen and rejected packed in one forward, scored at the last real token, Bradley–Terry) and
    `loss_denominator` (pairs), grad clip 1.0, AdamW."""

    def __init__(
        self, model, items: list, *, batch_size, micro_batch_size, lr, pad_id, checkpointing=False
    ):
        set_checkpointing(model, checkpointing)
        self.model, self.items, self.pad = model, items, pad_id
        self.B, self.mb = batch_size, micro_batch_size
        self.cfg = SimpleNamespace(
            kind="preference", loss=SimpleNamespace(margin=None, center_coef=0.0)
        )
        oc = optim_cfg(lr)
        self.opt = make_optimizer(model, oc)
        self.sched = make_scheduler(self.opt, oc, 10**6)
        self.order = itertools.cycle(range(len(items)))

    def step(self) -> None:
        from rlhflab.trainers.reward_model import loss_denominator, rm_losses

        model = self.model
        batch = [self.items[next(self.order)] for _ in range(self.B)]
        denom = loss_denominator(self.cfg, batch)
        self.opt.zero_grad(set_to_none=True)
        step_loss = torch.zeros(())
        acc_sum = acc_n = 0.0
        for s in range(0, len(batch), self.mb):
            mb = batch[s : s + self.mb]
            losses, weight, stats = rm_losses(self.cfg, model, mb, self.pad, "cpu", None)
            loss = losses.sum() / denom
            loss.backward()
            step_loss += loss.detach().cpu()
            acc_sum += float((stats["accuracy"] * weight).sum())
            acc_n += float(weight.sum())
        grad_norm = grad_norm_and_clip(model, 1.0)
        self.opt.step()
        self.sched.step()
        float(step_loss), float(grad_norm)

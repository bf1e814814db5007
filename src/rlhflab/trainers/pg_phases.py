"""The phases of one policy-gradient step (rlhflab.trainers.policy_gradient), as named functions:

    no_grad_passes   log-probs of the pre-update and the reference policy, the critic's values
    advantages       KL into the reward (kl.placement), `loss.advantage`, optional whitening
    update           update_epochs × minibatches optimizer steps, each over micro-batches
    step_metrics     the step's metrics (names in docs/metrics.md)

Rollout and scoring stay with the trainer (they sample with its engine and score with its
reward components). Every function here works on this rank's share of the global batch and
makes the same collectives, in the same order, on every rank. This module is the policy-gradient
family's own: only `trainers/policy_gradient.py` imports it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhflab import distributed, faults
from rlhflab.losses.advantages import ADVANTAGES, sum_pi_squared, token_rewards, whiten
from rlhflab.losses.aggregate import aggregate
from rlhflab.losses.correction import (
    decoupled,
    importance_weights,
    mismatch_stats,
    normalize_weights,
    rejection_mask,
    tis,
)
from rlhflab.losses.kl import kl_in_reward, kl_penalty
from rlhflab.losses.value import clipped_value_loss, explained_variance
from rlhflab.models.packing import can_pack
from rlhflab.ops import entropy_from_logits, position_ids_from_mask, selective_log_softmax, upcast
from rlhflab.rollout.dynamic import ScoredBatch
from rlhflab.rollout.sampler import completion_head, completion_logps
from rlhflab.trainers.common import grad_norm_and_clip, micro_batches


@dataclass
class Learners:
    """What the update trains: the policy and (PPO) the critic, each with its optimizer and LR
    schedule (the critic's three are None without a `value:` section)."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    value_model: torch.nn.Module | None = None
    value_optimizer: Any = None
    value_scheduler: Any = None


@dataclass
class StepData:
    """One step's tensors on this rank. `batch` is the global batch (every rank holds it);
    `local` this rank's share, whole groups, the global rows [r0, r1). Per-token tensors are
    (B_local, T): logp_old (None when no optimizer step needs it), logp_ref (None without a
    reference), values_old and returns (None without a critic), kl_reward_tok (the per-token KL
    that entered the reward, None otherwise); adv is (B_local,) or (B_local, T)."""

    batch: ScoredBatch
    local: ScoredBatch
    r0: int
    r1: int
    logp_old: torch.Tensor | None = None
    logp_ref: torch.Tensor | None = None
    values_old: torch.Tensor | None = None
    adv: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    kl_reward_tok: torch.Tensor | None = None
    baseline: torch.Tensor | None = None  # (B_local,) greedy rewards (ReMax)
    sum_pi_squared: torch.Tensor | None = None  # (B_local, T) Σ_v π(v)² (OTB)
    rc_weight: torch.Tensor | None = None  # (B_local, T) rollout-correction weight × keep mask


@dataclass
class UpdateStats:
    """What the update measured: masked sums of the first (on-policy) optimizer step (`sums`)
    and of every optimizer step (`update_sums`), per-rank until `step_metrics` reduces them;
    the summed losses and the grad norms of the optimizer steps."""

    sums: dict = field(default_factory=dict)
    update_sums: dict = field(default_factory=dict)
    loss_total: float = 0.0
    value_loss_total: float = 0.0
    grad_norms: list = field(default_factory=list)


def local_share(batch: ScoredBatch, batch_size: int, group_size: int) -> StepData:
    """This rank's share of the global batch: whole groups, the contiguous rows [r0, r1)."""
    r0, r1 = distributed.shard_bounds(batch_size)
    local = batch.select_groups(torch.arange(r0, r1, group_size) // group_size, group_size)
    return StepData(batch=batch, local=local, r0=r0, r1=r1)


def count_work(timer, data: StepData, batch: ScoredBatch, cfg) -> None:
    """The step's work for `timer` (`rlhflab.throughput`): tokens generated (global batch) and
    trained (completion tokens of the global batch: what the loss counts), and this rank's model
    FLOPs of the rollout (prefill + decode ≈ a forward over every real token at the padded
    width) and of the update (every real token, `update_epochs` times). The no-gradient passes
    are counted by `no_grad_passes`."""
    rollout = data.local.rollout
    tokens, width = float(rollout.attention_mask.sum()), rollout.attention_mask.size(1)
    completion = float(batch.rollout.mask.sum())
    timer.count(generated=completion, trained=completion)
    timer.forward("rollout", tokens, width)
    timer.train("update", tokens * cfg.train.update_epochs, width)


def no_grad_passes(data: StepData, learners: Learners, reference, cfg, autocast_dtype,
                   need_logp_old: bool, timer) -> None:  # fmt: skip
    """Phase 3: log-probs of the pre-update policy (when an optimizer step other than the first
    uses them, or the KL goes into the reward), of the reference policy (when there is one) and
    the critic's values (when there is one), in micro-batches without gradients; set on `data`.
    `timer` (`rlhflab.throughput.StageTimer`): stages logp_old, ref and values, and their FLOPs."""
    rollout, model, value_model = data.local.rollout, learners.model, learners.value_model
    tokens, width = float(rollout.attention_mask.sum()), rollout.attention_mask.size(1)
    # The policy's log-probs run through its own forward (FSDP2 gathers one layer at a time) and
    # every rank makes the same number of passes (common.micro_batches), so the sharded policy
    # is never gathered whole here.
    with timer.stage("logp_old"):
        data.logp_old = (
            no_grad_logps(model, rollout, cfg, autocast_dtype) if need_logp_old else None
        )
        if need_logp_old:
            timer.forward("logp_old", tokens, width)
    data.logp_ref = None
    if reference is not None:
        with timer.stage("ref"), reference.scoring() as ref_model:
            data.logp_ref = no_grad_logps(ref_model, rollout, cfg, autocast_dtype)
            timer.forward("ref", tokens, width)
    if ADVANTAGES[cfg.loss.advantage].needs_token_probs:
        with timer.stage("logp_old"), distributed.gathered(model):
            data.sum_pi_squared = no_grad_sum_pi_squared(model, rollout, cfg, autocast_dtype)
    with timer.stage("values"), distributed.gathered(value_model):
        data.values_old = (
            no_grad_values(value_model, rollout, cfg, autocast_dtype)
            if value_model is not None
            else None
        )


def reward_signal(local: ScoredBatch, cfg) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one place where per-token rewards are built: (rewards, steps). Without dense-credit
    rewards and for an estimator that does not take reward positions, the sequence rewards (B,)
    and None. Otherwise `token_rewards`: the dense step rewards at their steps' last tokens plus
    the sequence-level (outcome) reward at the last valid token, (B, T), and the positions
    where a reward is given (B, T) bool; the last token is one only when a weighted
    sequence-level component exists (`RewardConfig.has_outcome`). An estimator that takes the
    outcome apart (`needs_outcome`, PRIME) gets the dense rewards alone (B, T) (zeros without
    any); the outcome reaches it as `local.rewards` (`advantages`)."""
    advantage = ADVANTAGES[cfg.loss.advantage]
    if advantage.needs_outcome:
        zeros = torch.zeros_like(local.rewards)
        dense, _ = token_rewards(local.step_rewards, local.steps, zeros, local.rollout.mask,
                                 outcome=False)  # fmt: skip
        return dense, None
    if local.step_rewards is None and not advantage.needs_steps:
        return local.rewards, None
    return token_rewards(
        local.step_rewards, local.steps, local.rewards, local.rollout.mask,
        outcome=cfg.reward.has_outcome,
    )  # fmt: skip


def advantages(data: StepData, cfg, kl_coef: float, advantage_kwargs: dict) -> None:
    """Phase 4: the rewards (`reward_signal`: per token with dense credit); the KL penalty
    enters the reward when kl.placement says so (per sequence or per token); then
    `loss.advantage` with the kwargs its registry entry declares (group_size for group
    estimators, the reward positions `steps` for process supervision, the sequence-level
    `outcome` for PRIME's `prime_rloo`); an estimator that needs
    values (GAE) gets per-token rewards (the sequence reward at the last valid token) and the
    critic's values and also returns the λ-returns. Whitening uses the statistics of the global
    batch. Sets adv, returns, kl_reward_tok."""
    advantage = ADVANTAGES[cfg.loss.advantage]  # the estimator and what it declares it needs
    mask = data.local.rollout.mask
    rewards, steps = reward_signal(data.local, cfg)
    kl_reward_tok = None
    shaped = rewards
    if data.logp_ref is not None and cfg.kl.placement != "loss":
        kl_reward_tok = kl_penalty(data.logp_old, data.logp_ref, cfg.kl.estimator)
        shaped = kl_in_reward(
            rewards,
            kl_reward_tok,
            mask,
            coef=kl_coef,
            per_token=cfg.kl.placement == "reward_token",
        )
    returns = None
    if advantage.needs_values:
        if shaped.ndim == 1:  # sequence reward at the last token, no per-token penalty
            shaped = kl_in_reward(shaped, torch.zeros_like(mask), mask, coef=0.0, per_token=True)
        adv, returns = advantage.fn(shaped, data.values_old, mask, **advantage_kwargs)
    else:
        kwargs = dict(advantage_kwargs)
        if advantage.needs_greedy:
            kwargs["baseline"] = data.baseline
        if advantage.needs_token_probs:
            kwargs["logp"], kwargs["sum_pi_squared"] = data.local.rollout.logp, data.sum_pi_squared
        if advantage.needs_steps:
            kwargs["steps"] = steps
        if advantage.needs_outcome:  # the sequence-level reward apart from the dense ones
            kwargs["outcome"] = data.local.rewards
        if advantage.batch_stats:  # statistics of the global batch: computed on it, then sliced
            args = (distributed.gather_cat(shaped),)
            if advantage.needs_mask:
                args += (distributed.gather_cat(mask),)
            kwargs = {k: distributed.gather_cat(v) if torch.is_tensor(v) else v
                      for k, v in kwargs.items()}  # fmt: skip
            adv = advantage.fn(*args, **kwargs)[data.r0 : data.r1]
        else:
            args = (shaped, mask) if advantage.needs_mask else (shaped,)
            adv = advantage.fn(*args, **kwargs)
    if cfg.loss.whiten_advantages:  # statistics of the global batch
        adv_all = distributed.gather_cat(adv)
        mask_all = distributed.gather_cat(mask) if adv.ndim == 2 else None
        adv = whiten(adv_all, mask_all)[data.r0 : data.r1]
    data.adv, data.returns, data.kl_reward_tok = adv, returns, kl_reward_tok


def rollout_correction(data: StepData, cfg) -> None:
    """Phase 4b (loss.rollout_correction enabled): the per-token weight of the policy-gradient
    term, importance weight (token or sequence level, truncated, optionally normalised to mean 1
    over the global batch) times the rejection keep-mask, from π_old (the no-grad pass) and the
    sampler's log-probs of this rank's rows; sets data.rc_weight (B_local, T)."""
    rc = cfg.loss.rollout_correction
    rollout = data.local.rollout
    mask = rollout.mask
    w = torch.ones_like(data.logp_old)
    if rc.is_level != "none":
        w, _ = importance_weights(
            data.logp_old, rollout.logp, mask, level=rc.is_level, cap=rc.is_cap
        )
        if rc.batch_normalize:  # global mean: Σw and the count reduced over ranks
            m = mask.bool()
            if rc.is_level == "sequence":
                rows = m.any(-1)
                total = torch.where(rows, w.amax(-1), 0.0).sum()
                count = rows.sum()
            else:
                total, count = torch.where(m, w, 0.0).sum(), m.sum()
            sums = distributed.all_reduce_sum(
                torch.stack([total.to(torch.float64), count.to(torch.float64)])
            )
            w = normalize_weights(w, mask, level=rc.is_level, total=sums[0].to(w.dtype),
                                  count=sums[1].to(w.dtype))  # fmt: skip
    if rc.reject != "none":
        keep = rejection_mask(data.logp_old, rollout.logp, mask, level=rc.reject,
                              low=rc.reject_low, high=rc.reject_high)  # fmt: skip
        w = w * keep
    data.rc_weight = torch.where(mask.bool(), w, 0.0).detach()


def greedy_baseline(data: StepData, generate_and_score, group_size: int) -> dict:
    """Phase 2b (ReMax, an advantage with `needs_greedy`): one greedy completion per prompt of
    this rank's groups, through the rollout engine, scored by the same reward components
    (`generate_and_score(prompt_token_lists, problems) -> (rewards (n,), completion tokens)`); sets
    data.baseline (B_local,), each group's greedy reward on its rows. Returns the cost:
    {"perf/remax_greedy_s", "perf/remax_greedy_tokens"} (tokens summed over ranks)."""
    t0 = time.perf_counter()
    ro = data.local.rollout
    firsts = range(0, ro.prompt_ids.size(0), group_size)
    prompts = [ro.prompt_ids[i][ro.prompt_mask[i].bool()].tolist() for i in firsts]
    rewards, n_tokens = generate_and_score(prompts, [data.local.problems[i] for i in firsts])
    data.baseline = rewards.to(data.local.rewards.device).repeat_interleave(group_size)
    tokens = distributed.sum_dict({"t": float(n_tokens)})["t"]
    return {"perf/remax_greedy_s": time.perf_counter() - t0, "perf/remax_greedy_tokens": tokens}


def update(data: StepData, learners: Learners, guard, cfg, *, step: int, kl_coef: float,
           surrogate_fn, shuffle_rng: torch.Generator, autocast_dtype) -> UpdateStats:  # fmt: skip
    """Phase 5: update_epochs × minibatches optimizer steps over the rollout batch. Each
    accumulates micro-batches of `loss.surrogate` (+ kl_coef·KL when kl.placement is "loss"),
    reduced by `loss.aggregation` with denominators counted once per optimizer step over all
    micro-batches and ranks; the critic, if any, takes a step on the clipped value loss with its
    own optimizer. On the first optimizer step logp_old is the detached logp of the same forward
    (ratio exactly 1)."""
    batch_size = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    minibatch_size = batch_size // cfg.train.minibatches
    device = data.local.rollout.mask.device
    stats = UpdateStats()
    first_step = True
    select = getattr(surrogate_fn, "select", None)  # token choice over the whole minibatch
    if select is not None:  # every rank holds the global π_old log-probs and advantages
        logp_old_all = distributed.gather_cat(data.logp_old)
        adv_all = distributed.gather_cat(data.adv)
        mask_all = distributed.gather_cat(data.local.rollout.mask)
    k = 0
    for _epoch in range(cfg.train.update_epochs):
        perm = torch.randperm(batch_size, generator=shuffle_rng).to(device)
        for m in range(cfg.train.minibatches):
            mb_rows = perm[m * minibatch_size : (m + 1) * minibatch_size]  # global rows
            selected = None
            if select is not None:  # the same on every rank: same inputs, same seed
                gen = torch.Generator().manual_seed(hash((cfg.seed, step, k)) % 2**62)
                chosen = select(logp_old_all[mb_rows], adv_all[mb_rows], mask_all[mb_rows],
                                generator=gen, **cfg.loss.surrogate_args)  # fmt: skip
                selected = torch.zeros_like(mask_all, dtype=torch.bool)
                selected[mb_rows] = chosen
                selected = selected[data.r0 : data.r1]  # this rank's rows
            _optimizer_step(
                data, learners, guard, cfg, stats, mb_rows,
                step=step, kl_coef=kl_coef, surrogate_fn=surrogate_fn, first_step=first_step,
                autocast_dtype=autocast_dtype, selected=selected,
            )  # fmt: skip
            first_step = False
            k += 1
    return stats


def _optimizer_step(data: StepData, learners: Learners, guard, cfg, stats: UpdateStats, mb_rows,
                    *, step, kl_coef, surrogate_fn, first_step, autocast_dtype,
                    selected=None) -> None:  # fmt: skip
    """One optimizer step of the policy (and the critic) on the minibatch `mb_rows` (global
    rows), accumulated over this rank's micro-batches."""
    model, value_model = learners.model, learners.value_model
    rollout, r0, r1 = data.local.rollout, data.r0, data.r1
    device = rollout.mask.device
    minibatch_size = mb_rows.numel()
    sums, update_sums = stats.sums, stats.update_sums
    # Denominators of this optimizer step, counted once over all its micro-batches and all
    # ranks (every rank holds the global batch's mask).
    num_tokens = data.batch.rollout.mask[mb_rows].sum()
    mine = mb_rows[(mb_rows >= r0) & (mb_rows < r1)] - r0  # this rank's, in order
    learners.optimizer.zero_grad(set_to_none=True)
    step_loss = step_value_loss = 0.0  # this optimizer step's, for nan_policy
    if learners.value_optimizer is not None:
        learners.value_optimizer.zero_grad(set_to_none=True)
    # `weight` is 0 only for the padding passes that give every rank the same number of
    # forward/backward passes (distributed.micro_batches).
    mine_rows, widths = mine.tolist(), rollout.widths()
    for row_list, weight in micro_batches(
        cfg.train, mine_rows, [widths[i] for i in mine_rows], pad_row=0
    ):
        rows = torch.tensor(row_list, dtype=torch.long, device=device)
        micro = rollout.select(rows)
        if cfg.loss.entropy_coef > 0:  # the bonus needs the entropy's gradient
            logp, entropy_g = logps_with_entropy(model, micro, cfg.rollout.temperature,
                                                 autocast_dtype)  # fmt: skip
            entropy = entropy_g.detach()
        else:
            logp, entropy = completion_logps(
                model,
                micro,
                temperature=cfg.rollout.temperature,
                with_entropy=first_step,
                autocast_dtype=autocast_dtype,
            )
        old = logp.detach() if first_step else data.logp_old[rows]
        sel_kw = {} if selected is None else {"selected": selected[rows]}
        loss_tok, tok_stats = surrogate_fn(
            logp, old, data.adv[rows], micro.mask, **cfg.loss.surrogate_args, **sel_kw
        )
        if data.rc_weight is not None:  # rollout correction (IS weight × rejection mask)
            w = data.rc_weight[rows]
            loss_tok = loss_tok * w.to(loss_tok.dtype)
            tok_stats = {**tok_stats, "rc_weight": w}
        if cfg.loss.entropy_coef > 0:  # entropy bonus: −c·H per token, same aggregation
            loss_tok = loss_tok - cfg.loss.entropy_coef * entropy_g * micro.mask
        if cfg.loss.tis.enabled:  # training–inference mismatch correction
            old_trainer = logp.detach() if first_step else data.logp_old[rows]
            loss_tok, tis_stats = tis(
                loss_tok, old_trainer, micro.logp, micro.mask, cap=cfg.loss.tis.cap
            )
            tok_stats = {**tok_stats, **tis_stats}
        if cfg.rollout.mode == "async":  # stale rollouts: weight by min(π_prox / π_behav, C)
            prox = logp.detach() if first_step else data.logp_old[rows]
            weighted, behav_stats = decoupled(
                loss_tok, prox, micro.logp, micro.mask, cap=cfg.rollout.behav_cap
            )
            if cfg.rollout.behav_correction == "decoupled":
                loss_tok = weighted
            tok_stats = {**tok_stats, **behav_stats}
        if data.logp_ref is not None and cfg.kl.placement == "loss":
            kl_tok = kl_penalty(logp, data.logp_ref[rows], cfg.kl.estimator)
            loss_tok = loss_tok + kl_coef * kl_tok
            tok_stats = {**tok_stats, "kl": kl_tok.detach()}
        elif data.kl_reward_tok is not None:
            tok_stats = {**tok_stats, "kl": data.kl_reward_tok[rows]}
        loss = aggregate(
            loss_tok,
            micro.mask,
            cfg.loss.aggregation,
            num_tokens=num_tokens,
            num_seqs=minibatch_size,
            max_len=cfg.rollout.max_new_tokens,
        )
        loss = faults.corrupt("loss", step, loss) * weight
        loss.backward()
        step_loss += float(loss.detach())
        if value_model is not None:  # the critic regresses the λ-returns
            values = value_model(micro, autocast_dtype)
            v_tok, v_stats = clipped_value_loss(
                values,
                data.values_old[rows],
                data.returns[rows],
                micro.mask,
                clip_range=cfg.value.clip_range,
            )
            v_loss = weight * aggregate(v_tok, micro.mask, "token_mean", num_tokens=num_tokens)
            v_loss.backward()
            step_value_loss += float(v_loss.detach())
            _add(update_sums, "value/clip_frac", weight * v_stats["clipped"].sum())
        if weight:
            _accumulate_update(update_sums, micro.mask, tok_stats)
            if first_step:  # diagnostics of the batch under the sampling policy
                _accumulate(sums, micro, tok_stats, entropy, logp.detach())
    faults.hit("step_mid", step)
    global_loss = distributed.sum_dict({"p": step_loss, "v": step_value_loss})
    step_loss, step_value_loss = global_loss["p"], global_loss["v"]
    grad_norm = grad_norm_and_clip(model, cfg.optim.max_grad_norm)
    stats.grad_norms.append(grad_norm)
    stats.loss_total += step_loss
    stats.value_loss_total += step_value_loss
    finite = guard.check(step, {"policy/loss": step_loss, "optim/grad_norm": grad_norm})
    if finite:
        learners.optimizer.step()
        learners.scheduler.step()
    if learners.value_optimizer is not None:
        v_norm = grad_norm_and_clip(value_model, cfg.value.optim.max_grad_norm)
        if finite and guard.check(step, {"value/loss": step_value_loss, "value/grad_norm": v_norm}):
            learners.value_optimizer.step()
            learners.value_scheduler.step()


def step_metrics(data: StepData, stats: UpdateStats, cfg, *, sampling_stats: dict,
                 kl_coef: float, lr: float, dt: float,
                 verifier_errors: int) -> tuple[dict, float | None]:  # fmt: skip
    """Phase 6: the step's metrics on the global batch (names in docs/metrics.md; the masked
    sums reduced over ranks), and the KL per completion (summed over tokens) on the first
    optimizer step's minibatch (None without a KL term), which the KL controller reads."""
    batch, group_size = data.batch, cfg.rollout.group_size
    minibatch_size = cfg.rollout.prompts_per_step * group_size // cfg.train.minibatches
    optimizer_steps = cfg.train.update_epochs * cfg.train.minibatches
    metrics = _rollout_metrics(batch, group_size)  # the global batch
    metrics.update({f"rollout/{k}": v for k, v in sampling_stats.items()})
    sums, update_sums = _reduce_sums(stats.sums), _reduce_sums(stats.update_sums)  # over ranks
    n_tok = sums.pop("tokens")
    for name in ("rollout/logp_diff_max", "rollout/behav_ratio_max"):  # maxima, not sums
        if name in sums:
            metrics[name] = sums.pop(name).item()
    kl_seq = (sums["policy/kl"] / minibatch_size).item() if "policy/kl" in sums else None
    metrics.update({name: (value / n_tok).item() for name, value in sums.items()})
    metrics.update(_update_metrics(update_sums))
    if kl_seq is not None:
        metrics["policy/kl_seq"] = kl_seq
        metrics["policy/kl_coef"] = kl_coef
    if data.values_old is not None:
        v_all = distributed.gather_cat(data.values_old)
        ret_all = distributed.gather_cat(data.returns)
        mask_all = batch.rollout.mask
        metrics["value/loss"] = stats.value_loss_total / optimizer_steps
        metrics["value/explained_var"] = explained_variance(v_all, ret_all, mask_all).item()
        metrics["value/mean"] = (v_all.sum() / mask_all.sum()).item()
    metrics.update(
        {
            "policy/loss": stats.loss_total / optimizer_steps,
            "optim/grad_norm": torch.stack(stats.grad_norms).mean().item(),
            "optim/lr": lr,
            "perf/tokens_per_s": batch.rollout.mask.sum().item() / dt,
            "verifier/errors": verifier_errors,
        }
    )
    return metrics, kl_seq


def _by_micro_batch(rollout, cfg, fn) -> torch.Tensor:
    """(B, ...) `fn(micro)` (a no-gradient pass, (b, ...) per micro-batch) over the rollout's
    rows in this rank's micro-batches (`common.micro_batches`: fixed size or the token budget,
    as many passes as every other rank), each written back to its rows."""
    n = rollout.mask.size(0)
    out = None
    for rows, weight in micro_batches(cfg.train, list(range(n)), rollout.widths(), pad_row=0):
        idx = torch.tensor(rows, dtype=torch.long, device=rollout.mask.device)
        value = fn(rollout.select(idx))
        if weight:
            out = value.new_zeros((n, *value.shape[1:])) if out is None else out
            out[idx] = value
    return out


@torch.no_grad()
def no_grad_logps(model, rollout, cfg, autocast_dtype) -> torch.Tensor:
    """(B, T) log-probs of the rollout under `model`, computed in micro-batches."""
    return _by_micro_batch(
        rollout, cfg,
        lambda micro: completion_logps(
            model, micro, temperature=cfg.rollout.temperature, autocast_dtype=autocast_dtype
        )[0],
    )  # fmt: skip


def _logits(model, rollout, temperature, autocast_dtype) -> torch.Tensor:
    """(B, T, V) float logits / τ of the completion positions (the unfused path)."""
    width = rollout.completion_ids.size(1)
    attn = rollout.attention_mask
    with torch.autocast(rollout.input_ids.device.type, dtype=autocast_dtype,
                        enabled=autocast_dtype is not None):  # fmt: skip
        out = model(input_ids=rollout.input_ids, attention_mask=attn,
                    position_ids=position_ids_from_mask(attn), use_cache=False,
                    logits_to_keep=width + 1)  # fmt: skip
    logits = upcast(out.logits)[:, :-1]  # position P−1+t predicts o_t
    return logits / temperature if temperature != 1.0 else logits


def completion_logits_map(model, rollout, temperature, autocast_dtype, fn) -> torch.Tensor:
    """`fn` of the completion logits, back on the rollout's (B, T) grid: `fn` gets the (N, V)
    float logits / τ at the N scored tokens (`rollout.mask` > 0, row-major) and their (N,) ids
    and returns (N,) or (N, k) values; the result is (B, T) or (B, T, k), times `rollout.mask`
    (0 on padding), with gradients when `fn`'s have them.

    A model with a linear LM head (`models.packing.can_pack`) is run through its own forward
    with the head applied to those N hidden states only (`rollout.sampler.completion_head`:
    packed padding-free where rows are uneven, FSDP2-safe), so neither the padding nor the
    (B, T, V) logits are computed; any other model through `_logits` (padded, (B, T, V))."""
    sel = rollout.mask > 0
    tokens = rollout.completion_ids[sel]  # (N,)
    head = model.get_output_embeddings() if can_pack(model) else None
    if isinstance(head, torch.nn.Linear):

        def head_fn(hidden):  # (N, H), inside the model's forward (and its autocast)
            logits = upcast(torch.nn.functional.linear(hidden, head.weight, head.bias))
            return fn(logits / temperature if temperature != 1.0 else logits, tokens)

        autocast = torch.autocast(rollout.input_ids.device.type, dtype=autocast_dtype,
                                  enabled=autocast_dtype is not None)  # fmt: skip
        values = completion_head(model, rollout, head_fn, sel, autocast)
    else:
        values = fn(_logits(model, rollout, temperature, autocast_dtype)[sel], tokens)
    grid = values.new_zeros((*sel.shape, *values.shape[1:]))
    grid = grid.index_put(tuple(sel.nonzero().unbind(1)), values)
    mask = rollout.mask.to(grid.dtype)  # times the mask, as `completion_logps` returns log-probs
    return grid * (mask if grid.dim() == 2 else mask.unsqueeze(-1))


def logps_with_entropy(model, rollout, temperature, autocast_dtype):
    """(B, T) log-probs of the completion tokens and (B, T) entropy of π_θ(·|o_<t), both with
    gradients (for the entropy bonus), 0 at padding. The logits of the scored tokens only,
    packed padding-free where rows are uneven (`completion_logits_map`); the (N, V) logits of
    those tokens are held (the fused head of `completion_logps` has no entropy gradient)."""

    def both(logits, tokens):  # (N, V), (N,) -> (N, 2)
        return torch.stack([selective_log_softmax(logits, tokens),
                            entropy_from_logits(logits)], dim=-1)  # fmt: skip

    out = completion_logits_map(model, rollout, temperature, autocast_dtype, both)
    return out[..., 0], out[..., 1]


@torch.no_grad()
def no_grad_sum_pi_squared(model, rollout, cfg, autocast_dtype) -> torch.Tensor:
    """(B, T) Σ_v π(v | o_<t)² of the tempered policy at each completion position (OTB's
    realised energy), in micro-batches, 0 at padding (`completion_logits_map`: packed
    padding-free where rows are uneven)."""
    return _by_micro_batch(
        rollout, cfg,
        lambda micro: completion_logits_map(
            model, micro, cfg.rollout.temperature, autocast_dtype,
            lambda logits, tokens: sum_pi_squared(logits),
        ),
    )  # fmt: skip


@torch.no_grad()
def no_grad_values(value_model, rollout, cfg, autocast_dtype) -> torch.Tensor:
    """(B, T) critic values of the rollout, computed in micro-batches."""
    return _by_micro_batch(rollout, cfg, lambda micro: value_model(micro, autocast_dtype))


def _add(sums: dict, name: str, value) -> None:
    sums[name] = sums.get(name, 0.0) + value


def _accumulate(sums: dict, micro, stats: dict, entropy, logp) -> None:
    """Masked sums of per-token diagnostics of the first (on-policy) optimizer step; divided by the
    step's token count when logged. (The ratio's extremes are 1 there by construction; they are
    tracked over every optimizer step by `_accumulate_update`.)"""
    mask = micro.mask

    def add(name: str, value: torch.Tensor) -> None:
        _add(sums, name, value)

    add("tokens", mask.sum())
    add("policy/entropy", (entropy * mask).sum())
    add("policy/ratio_mean", (stats["ratio"] * mask).sum())
    add("policy/clip_frac_low", (stats["clipped_low"] * mask).sum())
    add("policy/clip_frac_high", (stats["clipped_high"] * mask).sum())
    # Training–inference mismatch on the sampled tokens (0 up to rounding with the hf engine).
    # Not under async rollouts: there it would measure the policy lag (the behaviour ratio's job)
    # and trip the logp_mismatch health check.
    if "behav_ratio" not in stats:
        mm = mismatch_stats(logp, micro.logp, mask)
        add("rollout/logp_diff_mean", mm["logp_diff"].sum())
        add("rollout/sampler_kl", mm["sampler_kl"].sum())
        hi = mm["logp_diff"].max() if mask.numel() else torch.zeros(())
        sums["rollout/logp_diff_max"] = torch.maximum(sums.get("rollout/logp_diff_max", hi), hi)
    if "tis_weight" in stats:
        add("rollout/tis_weight_mean", (stats["tis_weight"] * mask).sum())
        add("rollout/tis_capped_frac", (stats["capped"] * mask).sum())
    if "behav_ratio" in stats:  # async rollouts: π_prox / π_behav on the sampled tokens
        add("rollout/behav_ratio_mean", (stats["behav_ratio"] * mask).sum())
        add("rollout/behav_capped_frac", (stats["behav_capped"] * mask).sum())
        hi = stats["behav_ratio"].max() if mask.numel() else torch.zeros(())
        sums["rollout/behav_ratio_max"] = torch.maximum(sums.get("rollout/behav_ratio_max", hi), hi)
    if "rc_weight" in stats:  # rollout correction: mean weight, share of rejected tokens
        add("rollout/rc_weight_mean", (stats["rc_weight"] * mask).sum())
        add("rollout/rc_zero_frac", ((stats["rc_weight"] == 0) * mask).sum())
    if "cov_selected" in stats:  # Clip-Cov / KL-Cov: share of chosen tokens
        add("policy/cov_selected_frac", (stats["cov_selected"] * mask).sum())
    if "kl" in stats:
        add("policy/kl", (stats["kl"] * mask).sum())


def _accumulate_update(sums: dict, mask, stats: dict) -> None:
    """Ratio and clip statistics over every optimizer step of the batch (off-policy included)."""
    m = mask.bool()
    _add(sums, "tokens", mask.sum())
    _add(sums, "update/ratio_mean", (stats["ratio"] * mask).sum())
    _add(sums, "update/clip_frac_low", (stats["clipped_low"] * mask).sum())
    _add(sums, "update/clip_frac_high", (stats["clipped_high"] * mask).sum())
    hi = stats["ratio"].masked_fill(~m, float("-inf")).max()  # -inf / inf: no valid token
    lo = stats["ratio"].masked_fill(~m, float("inf")).min()
    sums["ratio_max"] = torch.maximum(sums.get("ratio_max", hi), hi)
    sums["ratio_min"] = torch.minimum(sums.get("ratio_min", lo), lo)


def _reduce_sums(sums: dict) -> dict:
    """Per-rank masked sums → global ones: summed over ranks, except the ratio extremes (max /
    min), in float64. A key some rank lacks (it had no rows in that minibatch) counts as 0 / ∓inf
    there."""
    keys = sorted({k for part in distributed.all_gather_object(sorted(sums)) for k in part})
    default = {"ratio_max": float("-inf"), "ratio_min": float("inf"), "rollout/logp_diff_max": 0.0,
               "rollout/behav_ratio_max": 0.0}  # fmt: skip
    out = {}
    for k in keys:
        v = sums.get(k, default.get(k, 0.0))
        # float64, as distributed.sum_dict: the same dtype on every rank, and a float64 run's
        # sums keep their precision
        if torch.is_tensor(v):
            v = v.detach().to(torch.float64).clone()
        else:
            v = torch.tensor(float(v), dtype=torch.float64)
        if k in ("ratio_max", "rollout/logp_diff_max", "rollout/behav_ratio_max"):
            out[k] = distributed.all_reduce_max(v)
        elif k == "ratio_min":
            out[k] = distributed.all_reduce_min(v)
        else:
            out[k] = distributed.all_reduce_sum(v)
    return out


def _update_metrics(sums: dict) -> dict:
    n_tok = sums.pop("tokens")
    out = {k: (v / n_tok).item() for k, v in sums.items() if not k.startswith("ratio_")}
    if "ratio_max" in sums and torch.isfinite(sums["ratio_max"]):
        out["update/ratio_max"] = sums["ratio_max"].item()
        out["update/ratio_min"] = sums["ratio_min"].item()
    return out


def _rollout_metrics(batch: ScoredBatch, group_size: int) -> dict:
    """Reward (total and per component), accuracy, length and truncation of one rollout batch."""
    rewards, rollout = batch.rewards, batch.rollout
    correct = batch.components.get("correctness", batch.components.get("math_verify", rewards))
    grouped = rewards.view(-1, group_size)
    lengths = rollout.lengths
    metrics = {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "rollout/accuracy": (correct == 1.0).float().mean().item(),
        "rollout/response_len_mean": lengths.mean().item(),
        "rollout/response_len_max": lengths.max().item(),
        "rollout/truncated_frac": rollout.truncated.float().mean().item(),
        "rollout/zero_std_group_frac": (grouped.std(1) == 0).float().mean().item()
        if group_size > 1
        else 0.0,
    }
    if batch.steps is not None:  # dense credit: how many step rewards a completion got
        n_steps = batch.steps.sum(-1).float()
        metrics["rollout/steps_mean"] = n_steps.mean().item()
        metrics["rollout/no_step_frac"] = (n_steps == 0).float().mean().item()
    for name, values in batch.components.items():
        values = values[~values.isnan()]  # a reward function's None entries are NaN
        if values.numel() == 0:  # no sample of the batch got this reward
            continue
        metrics[f"rollout/reward/{name}_mean"] = values.mean().item()
        metrics[f"rollout/reward/{name}_std"] = values.std().item() if values.numel() > 1 else 0.0
    return metrics

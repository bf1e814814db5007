"""Policy-gradient RL with verifier rewards: the REINFORCE / RLOO / PPO / GRPO family, composed from
named parts.

Each step reads top to bottom:
    1. rollout     sample `group_size` completions for each of `prompts_per_step` prompts; with
                   dynamic sampling, keep drawing prompts until every group's rewards vary
    2. rewards     score every completion: Σ weight·component (verifier correctness, format, length,
                   overlong, ...), each component logged on its own
    3. old / ref   log-probs of the pre-update policy (when more than one optimizer step uses the
                   batch, or the KL goes into the reward), of the reference policy (when kl.coef > 0)
                   and the critic's values (when there is a value model), without gradients
    4. advantages  KL into the reward if kl.placement says so (per sequence or per token), then
                   `loss.advantage` (group baselines on sequence rewards; GAE on token rewards and
                   values), optionally whitened
    5. update      update_epochs × minibatches optimizer steps; each accumulates micro-batches of
                   `loss.surrogate` (+ kl.coef · KL when kl.placement is "loss"), reduced by
                   `loss.aggregation` with denominators counted once per optimizer step; the value
                   model, if any, takes a step on the clipped value loss with its own optimizer
    6. log         metrics (names in docs/metrics.md), samples every N steps, held-out eval; the
                   adaptive KL controller updates kl.coef
At the end: held-out evaluation, the model (and value model) in HF format, plots and
final_results.json.

The algorithm is the preset's composition (see configs/pg/*.yaml); this loop has no branch per
paper. On the first optimizer step of a batch, logp_old is the detached logp of the same forward,
so the ratio is exactly 1 there.
"""

from __future__ import annotations

import inspect
import itertools
import random
import time

import torch

from rlhflab import distributed, faults
from rlhflab.checkpoint import Checkpointer, StopSignals
from rlhflab.config import PGConfig
from rlhflab.data.formatting import encode_prompt, task_instruction
from rlhflab.data.prompts import load_prompt_source, render_row
from rlhflab.data.tasks import task_texts
from rlhflab.eval.accuracy import majority_baseline, majority_results
from rlhflab.fingerprint import data_fingerprint
from rlhflab.health import HealthMonitor
from rlhflab.losses.advantages import ADVANTAGES, whiten
from rlhflab.losses.aggregate import aggregate
from rlhflab.losses.correction import mismatch_stats, tis
from rlhflab.losses.kl import adaptive_kl_coef, kl_in_reward, kl_penalty
from rlhflab.losses.policy import POLICY_LOSSES
from rlhflab.losses.value import clipped_value_loss, explained_variance
from rlhflab.models.loading import context_length
from rlhflab.models.lora import apply_lora, merged_state
from rlhflab.models.value import ValueModel
from rlhflab.plots import plot_run
from rlhflab.rewards.reward_model import (
    check_reward_model_paths,
    load_running_norm_state,
    running_norm_state,
)
from rlhflab.rewards.shaping import TextRewardScorer, score_components
from rlhflab.rewards.verifier import Verifier
from rlhflab.rollout.dynamic import ScoredBatch, dynamic_sample
from rlhflab.rollout.engines import SamplingParams, make_engine
from rlhflab.rollout.sampler import completion_logps, decode_completions, draw_seed
from rlhflab.runs import SampleWriter, write_json_atomic
from rlhflab.tracking import Tracker, read_metrics
from rlhflab.trainers.common import (
    NonFiniteGuard,
    Reference,
    ShuffledStream,
    check_generation_budget,
    check_lengths,
    default_device,
    grad_norm_and_clip,
    heldout_eval,
    make_optimizer,
    make_scheduler,
    prepare_model,
    save_final_model,
    seed_everything,
    setup_precision,
)
from rlhflab.trainers.loop import TimeBudget, open_run, resume_point


def train(cfg: PGConfig) -> dict:
    """Run policy-gradient RL as configured; returns final results (also in final_results.json)."""
    t_start = time.perf_counter()
    # -- 0. Set-up: all validation happens here, before the run directory exists.
    ckpt = resume_point(cfg)  # the verified checkpoint to continue from, or None
    seed_everything(cfg.seed)
    device = default_device()
    autocast_dtype = setup_precision(cfg.precision, device)
    t = cfg.task
    # Prompt rows (task problems or a dataset's rows) with a deduplicated held-out split.
    splits = load_prompt_source(cfg.data, t, seed=cfg.seed)
    system = t.system if cfg.data.source == "task" else cfg.data.system
    # The answer-format instruction after each task question (task.instruction); none for datasets.
    instruction = task_instruction(t) if cfg.data.source == "task" else None
    tokenizer, model = prepare_model(
        cfg.model,
        device=device,
        seed=cfg.seed,
        tokenizer_texts=lambda: task_texts(splits, cfg.model.build.tokenizer_texts),
        sharded_later=True,  # weights used after wrap only
    )
    prompts = [
        encode_prompt(tokenizer, render_row(tokenizer, p, system=system, instruction=instruction))
        for p in splits.train
    ]
    check_generation_budget(context_length(model), cfg.rollout.max_new_tokens,
                            field="rollout.max_new_tokens")  # fmt: skip
    limit = context_length(model) - cfg.rollout.max_new_tokens
    check_lengths([len(p) for p in prompts], limit, what="prompt", field=f"{splits.source} train")
    verifier = Verifier(answer_format=t.answer_format, reward=t.reward, extractor=t.extractor)
    check_reward_model_paths(cfg.reward.components)
    # Held-out score: the task's verifier, or a dataset's text-computable rewards.
    scorer = verifier if cfg.data.source == "task" else TextRewardScorer(cfg.reward.components)
    # (No held-out eval when no reward can score text alone, e.g. a reward model only.)
    heldout = splits.heldout[: cfg.eval.n] if scorer is verifier or scorer.components else []
    # Beside every task accuracy: the most common training answer given to every held-out problem.
    baseline = majority_baseline(splits.train, heldout, verifier) if scorer is verifier else None
    distributed.check_split(
        cfg.rollout.prompts_per_step, "rollout.prompts_per_step", "prompts",
        why="whole groups go to one rank",
    )  # fmt: skip
    model = apply_lora(model, cfg.model.lora)  # model.lora unset: unchanged
    # π_ref: a frozen copy of the initial policy, or (LoRA) the policy with adapters disabled.
    reference = Reference(model, cfg.parallel) if cfg.kl.coef > 0 else None
    kl_coef = cfg.kl.coef  # changes only under the adaptive controller
    kl_in_loss = cfg.kl.placement == "loss"
    value_model = value_optimizer = value_scheduler = None
    if cfg.value is not None:  # PPO's critic: its own weights, optimizer and LR
        value_model = (
            ValueModel.load(cfg.value.init_from, device)
            if cfg.value.init_from
            else ValueModel.from_policy(model)
        )
        value_model.train()
    # Data parallelism (one process: nothing changes): the policy, the frozen reference and the
    # critic are placed and sharded alike.
    model = distributed.wrap(model, cfg.parallel)
    value_model = distributed.wrap(value_model, cfg.parallel) if value_model else None
    # The rollout engine (rollout.engine): "hf" samples with `model` itself; "vllm" holds its own
    # copy of the weights, pushed after every update.
    engine = make_engine(cfg.rollout, model, tokenizer, autocast_dtype=autocast_dtype)
    sampling = SamplingParams(
        n=cfg.rollout.group_size,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        min_p=cfg.rollout.min_p,
    )
    advantage_fn = ADVANTAGES[cfg.loss.advantage]
    advantage_kwargs = dict(cfg.loss.advantage_args)
    if "group_size" in inspect.signature(advantage_fn).parameters:
        advantage_kwargs["group_size"] = cfg.rollout.group_size
    surrogate_fn = POLICY_LOSSES[cfg.loss.surrogate]
    group_size = cfg.rollout.group_size
    batch_size = cfg.rollout.prompts_per_step * group_size
    minibatch_size = batch_size // cfg.train.minibatches
    optimizer_steps_per_batch = cfg.train.update_epochs * cfg.train.minibatches
    total_optimizer_steps = cfg.train.steps * optimizer_steps_per_batch
    optimizer = make_optimizer(model, cfg.optim)
    scheduler = make_scheduler(optimizer, cfg.optim, total_optimizer_steps)
    if value_model is not None:
        value_optimizer = make_optimizer(value_model, cfg.value.optim)
        value_scheduler = make_scheduler(value_optimizer, cfg.value.optim, total_optimizer_steps)
    need_logp_old = optimizer_steps_per_batch > 1 or (reference is not None and not kl_in_loss)
    sampler_rng = torch.Generator(device=device).manual_seed(cfg.seed)
    shuffle_rng = torch.Generator().manual_seed(cfg.seed + 1)
    prompt_stream = ShuffledStream(
        len(prompts), random.Random(cfg.seed), fingerprint=data_fingerprint(prompts),
        allow_change=cfg.run.allow_config_change,
    )  # fmt: skip
    guard = NonFiniteGuard(cfg.train.nan_policy, cfg.train.nan_max_skips)

    # -- 1. Run directory (a resumed run continues in its own).
    run_dir = open_run(cfg, ckpt)
    tracker = Tracker.for_run(
        run_dir, cfg, headline=("rollout/reward_mean", "policy/kl", "eval/accuracy"), ckpt=ckpt
    )
    samples = SampleWriter(run_dir, enabled=distributed.is_main(), tracker=tracker)
    health = HealthMonitor(cfg.health, model, print_fn=tracker.warn)
    tracker.print(
        f"run directory: {run_dir}  (train prompts {len(prompts)}, held-out {len(heldout)}, "
        f"held-out dropped as seen in training: {splits.n_heldout_overlap_dropped})"
    )

    def run_eval(step: int) -> dict:
        res = heldout_eval(
            cfg, model, tokenizer, heldout, scorer, tracker, step, autocast_dtype,
            system=system, instruction=instruction, baseline=baseline, engine=engine,
        )  # fmt: skip
        engine.sleep()
        health.observe_eval(step, res)
        return res

    def draw(chosen: list[int]) -> ScoredBatch:
        """Phases 1-2 for the given prompts (the global list): sample group_size completions each,
        then score. Each data-parallel rank samples and scores a contiguous share of the groups
        (global rows `rows`: the draws do not depend on the split); the scored shares are then
        gathered, so every rank returns the same global batch."""
        g0, g1 = distributed.shard_bounds(len(chosen), even=False)
        mine = chosen[g0:g1]
        if not mine:  # more ranks than prompts in a dynamic-sampling round's remainder
            draw_seed(sampler_rng, device)  # the draw `sample` would take: stay in step
            return ScoredBatch.gather(None, tokenizer.pad_token_id, device)
        problems = [splits.train[i] for i in mine for _ in range(group_size)]
        model.eval()
        engine.wake()
        with distributed.gathered(model):
            rollout = engine.generate(
                [prompts[i] for i in mine],
                sampling,
                generator=sampler_rng,
                rows=list(range(g0 * group_size, g1 * group_size)),  # global rows: noise
                n_rows=len(chosen) * group_size,
                width=max(len(prompts[i]) for i in chosen),  # the global batch's prompt width
            )
        engine.sleep()
        model.train()
        texts = decode_completions(tokenizer, rollout, engine.stop_token_ids)
        rewards, components = score_components(
            cfg.reward.components,
            {
                "texts": texts,
                "problems": problems,
                "verifier": verifier,
                "lengths": rollout.lengths.cpu(),
                "truncated": rollout.truncated.cpu(),
                "max_new_tokens": cfg.rollout.max_new_tokens,
                "rollout": rollout,
            },
            where=f"step {step}",
        )
        components = {k: v.to(device) for k, v in components.items()}
        local = ScoredBatch(rollout, rewards.to(device), components, texts, problems)
        return ScoredBatch.gather(local, tokenizer.pad_token_id, device)

    # Checkpoints hold both models, optimizers and schedules, every RNG stream, the prompt
    # stream's position, the KL controller's coefficient and the counters.
    checkpointer = Checkpointer(
        run_dir,
        cfg.model_dump(mode="json"),
        modules={"model": model, "value_model": value_model},
        optimizers={"optimizer": optimizer, "value_optimizer": value_optimizer},
        schedulers={"scheduler": scheduler, "value_scheduler": value_scheduler},
        generators={"sampler": sampler_rng, "shuffle": shuffle_rng},
        stateful={"prompts": prompt_stream, "nan": guard, "health": health, "tracker": tracker},
        every=cfg.checkpoint.every,
        keep_last=cfg.checkpoint.keep_last,
        resumed_from=ckpt,
        tokenizer=tokenizer,
    )

    def state() -> dict:
        return {
            "kl_coef": kl_coef,
            "initial_eval": initial_eval,
            "verifier_errors": verifier.n_errors,
            "reward_norm": running_norm_state(),
        }

    if ckpt is not None:
        st = checkpointer.resume(ckpt, tracker, cfg.train.steps)
        kl_coef, initial_eval = st["kl_coef"], st["initial_eval"]
        verifier.n_errors = st["verifier_errors"]
        load_running_norm_state(st.get("reward_norm", {}))
    else:
        load_running_norm_state({})
        initial_eval = run_eval(0) if heldout else {}
    steps_done = ckpt.step if ckpt is not None else 0
    budget = TimeBudget(cfg.train.max_seconds, cfg.train.steps, t_start)
    with StopSignals() as stop:  # SIGTERM / SIGINT: finish the step, checkpoint, exit
        for step in range(steps_done + 1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            # -- 1-2. Rollout and rewards: prompts_per_step prompts, each repeated group_size times
            #         (group-contiguous), scored by the reward components. Dynamic sampling draws
            #         further rounds and keeps only groups whose rewards are not all equal.
            if cfg.rollout.dynamic_sampling.enabled:
                ds = cfg.rollout.dynamic_sampling
                batch, sampling_stats = dynamic_sample(
                    itertools.islice(prompt_stream, ds.max_rounds * cfg.rollout.prompts_per_step),
                    draw,
                    n_groups=cfg.rollout.prompts_per_step,
                    group_size=group_size,
                    pad_token_id=tokenizer.pad_token_id,
                )
            else:
                batch = draw(list(itertools.islice(prompt_stream, cfg.rollout.prompts_per_step)))
                sampling_stats = {}
            # `batch` is the global batch (every rank holds it); this rank trains on its share:
            # whole groups, the contiguous rows [r0, r1).
            r0, r1 = distributed.shard_bounds(batch_size)
            local = batch.select_groups(torch.arange(r0, r1, group_size) // group_size, group_size)
            rollout, rewards, mask = local.rollout, local.rewards, local.rollout.mask
            t_rollout = time.perf_counter() - t0

            # -- 3. Log-probs of the pre-update and the reference policy, and the critic's values, in
            #       micro-batches without gradients.
            with distributed.gathered(model):
                logp_old = (
                    _no_grad_logps(model, rollout, cfg, autocast_dtype) if need_logp_old else None
                )
            logp_ref = None
            if reference is not None:
                with reference.scoring() as ref_model:
                    logp_ref = _no_grad_logps(ref_model, rollout, cfg, autocast_dtype)
            with distributed.gathered(value_model):
                values_old = (
                    _no_grad_values(value_model, rollout, cfg, autocast_dtype)
                    if value_model is not None
                    else None
                )

            # -- 4. Advantages. The KL penalty enters the reward here when placed there; a per-token
            #       advantage (GAE) gets the sequence reward at the last valid token.
            kl_reward_tok = None
            shaped = rewards
            if logp_ref is not None and not kl_in_loss:
                kl_reward_tok = kl_penalty(logp_old, logp_ref, cfg.kl.estimator)
                shaped = kl_in_reward(
                    rewards,
                    kl_reward_tok,
                    mask,
                    coef=kl_coef,
                    per_token=cfg.kl.placement == "reward_token",
                )
            returns = None
            if values_old is not None:
                if shaped.ndim == 1:  # sequence reward at the last token, no per-token penalty
                    shaped = kl_in_reward(
                        shaped, torch.zeros_like(mask), mask, coef=0.0, per_token=True
                    )
                adv, returns = advantage_fn(shaped, values_old, mask, **advantage_kwargs)
            else:
                adv = advantage_fn(shaped, **advantage_kwargs)
            if cfg.loss.whiten_advantages:  # statistics of the global batch
                adv_all = distributed.gather_cat(adv)
                mask_all = distributed.gather_cat(mask) if adv.ndim == 2 else None
                adv = whiten(adv_all, mask_all)[r0:r1]

            # -- 5. Update: update_epochs × minibatches optimizer steps over the rollout batch.
            sums: dict[str, torch.Tensor] = {}
            update_sums: dict[str, torch.Tensor] = {}
            loss_total, value_loss_total, grad_norms, first_step = 0.0, 0.0, [], True
            for _epoch in range(cfg.train.update_epochs):
                perm = torch.randperm(batch_size, generator=shuffle_rng).to(device)
                for m in range(cfg.train.minibatches):
                    mb_rows = perm[m * minibatch_size : (m + 1) * minibatch_size]  # global rows
                    # Denominators of this optimizer step, counted once over all its micro-batches
                    # and all ranks (every rank holds the global batch's mask).
                    num_tokens = batch.rollout.mask[mb_rows].sum()
                    mine = mb_rows[(mb_rows >= r0) & (mb_rows < r1)] - r0  # this rank's, in order
                    optimizer.zero_grad(set_to_none=True)
                    step_loss = step_value_loss = 0.0  # this optimizer step's, for nan_policy
                    if value_optimizer is not None:
                        value_optimizer.zero_grad(set_to_none=True)
                    # `weight` is 0 only for the padding passes that give every rank the same
                    # number of forward/backward passes (distributed.micro_batches).
                    for row_list, weight in distributed.micro_batches(
                        mine.tolist(), cfg.train.micro_batch_size, pad_row=0
                    ):
                        rows = torch.tensor(row_list, dtype=torch.long, device=device)
                        micro = rollout.select(rows)
                        logp, entropy = completion_logps(
                            model,
                            micro,
                            temperature=cfg.rollout.temperature,
                            with_entropy=first_step,
                            autocast_dtype=autocast_dtype,
                        )
                        old = logp.detach() if first_step else logp_old[rows]
                        loss_tok, stats = surrogate_fn(
                            logp, old, adv[rows], micro.mask, **cfg.loss.surrogate_args
                        )
                        if cfg.loss.tis.enabled:  # training–inference mismatch correction
                            old_trainer = logp.detach() if first_step else logp_old[rows]
                            loss_tok, tis_stats = tis(
                                loss_tok, old_trainer, micro.logp, micro.mask, cap=cfg.loss.tis.cap
                            )
                            stats = {**stats, **tis_stats}
                        if logp_ref is not None and kl_in_loss:
                            kl_tok = kl_penalty(logp, logp_ref[rows], cfg.kl.estimator)
                            loss_tok = loss_tok + kl_coef * kl_tok
                            stats = {**stats, "kl": kl_tok.detach()}
                        elif kl_reward_tok is not None:
                            stats = {**stats, "kl": kl_reward_tok[rows]}
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
                                values_old[rows],
                                returns[rows],
                                micro.mask,
                                clip_range=cfg.value.clip_range,
                            )
                            v_loss = weight * aggregate(
                                v_tok, micro.mask, "token_mean", num_tokens=num_tokens
                            )
                            v_loss.backward()
                            step_value_loss += float(v_loss.detach())
                            _add(update_sums, "value/clip_frac", weight * v_stats["clipped"].sum())
                        if weight:
                            _accumulate_update(update_sums, micro.mask, stats)
                            if first_step:  # diagnostics of the batch under the sampling policy
                                _accumulate(sums, micro, stats, entropy, logp.detach())
                    faults.hit("step_mid", step)
                    global_loss = distributed.sum_dict({"p": step_loss, "v": step_value_loss})
                    step_loss, step_value_loss = global_loss["p"], global_loss["v"]
                    grad_norm = grad_norm_and_clip(model, cfg.optim.max_grad_norm)
                    grad_norms.append(grad_norm)
                    loss_total += step_loss
                    value_loss_total += step_value_loss
                    finite = guard.check(
                        step, {"policy/loss": step_loss, "optim/grad_norm": grad_norm}
                    )
                    if finite:
                        optimizer.step()
                        scheduler.step()
                    if value_optimizer is not None:
                        v_norm = grad_norm_and_clip(value_model, cfg.value.optim.max_grad_norm)
                        if finite and guard.check(
                            step, {"value/loss": step_value_loss, "value/grad_norm": v_norm}
                        ):
                            value_optimizer.step()
                            value_scheduler.step()
                    first_step = False
            engine.update_weights(model.named_parameters())  # "hf": nothing to do
            steps_done = step
            dt = time.perf_counter() - t0

            # -- 6. Log, then let the adaptive controller move kl.coef.
            metrics = _rollout_metrics(batch, group_size)  # the global batch
            metrics.update({f"rollout/{k}": v for k, v in sampling_stats.items()})
            sums, update_sums = _reduce_sums(sums), _reduce_sums(update_sums)  # over ranks
            n_tok = sums.pop("tokens")
            if "rollout/logp_diff_max" in sums:  # a maximum, not a sum
                metrics["rollout/logp_diff_max"] = sums.pop("rollout/logp_diff_max").item()
            # KL per completion (summed over tokens) on the first optimizer step's minibatch.
            kl_seq = (sums["policy/kl"] / minibatch_size).item() if "policy/kl" in sums else None
            metrics.update({name: (value / n_tok).item() for name, value in sums.items()})
            metrics.update(_update_metrics(update_sums))
            if kl_seq is not None:
                metrics["policy/kl_seq"] = kl_seq
                metrics["policy/kl_coef"] = kl_coef
            if value_model is not None:
                v_all, ret_all = distributed.gather_cat(values_old), distributed.gather_cat(returns)
                mask_all = batch.rollout.mask
                metrics["value/loss"] = value_loss_total / optimizer_steps_per_batch
                metrics["value/explained_var"] = explained_variance(v_all, ret_all, mask_all).item()
                metrics["value/mean"] = (v_all.sum() / mask_all.sum()).item()
            if cfg.train.nan_policy == "skip":
                metrics["train/nan_skips"] = guard.skipped
            metrics.update(
                {
                    "policy/loss": loss_total / optimizer_steps_per_batch,
                    "optim/grad_norm": torch.stack(grad_norms).mean().item(),
                    "optim/lr": scheduler.get_last_lr()[0],
                    "perf/step_s": dt,
                    "perf/rollout_s": t_rollout,
                    "perf/tokens_per_s": batch.rollout.mask.sum().item() / dt,
                    "verifier/errors": verifier.n_errors,
                }
            )
            if cfg.kl.controller == "adaptive" and kl_seq is not None:
                kl_coef = adaptive_kl_coef(
                    kl_coef,
                    kl_seq,
                    target=cfg.kl.target,
                    horizon=cfg.kl.horizon,
                    n_steps=batch_size,
                )
            metrics.update(
                health.check(  # on the global batch: every rank sees the same
                    step,
                    metrics,
                    rollout=batch.rollout,
                    adv=distributed.gather_cat(adv),
                    texts=batch.texts,
                    group_size=group_size,
                    correct=batch.components.get("correctness"),
                )
            )
            if step % cfg.tracking.log_every == 0 or step == cfg.train.steps:
                tracker.log(step, metrics)
            if step % cfg.tracking.samples_every == 0 or step == 1:
                n = cfg.tracking.samples_per_step
                samples.write(
                    step,
                    [
                        {
                            "prompt": batch.problems[i].question,
                            "completion": batch.texts[i],
                            "reward": batch.rewards[i].item(),
                            "answer": batch.problems[i].answer,
                        }
                        for i in range(min(n, len(batch.texts)))
                    ],
                )
            if heldout and cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
                metrics.update({f"eval/{k}": v for k, v in run_eval(step).items()})
            tracker.advance(step, metrics)
            checkpointer.end_step(
                step, stop, state, on_stop=(tracker.close, samples.close), halt=health.halt()
            )
            if budget.expired(step):  # per invocation; never after the last step
                break
    budget.say_stop(tracker)
    checkpointer.finish(steps_done, state(), stopped=budget.stopped_at is not None)

    final_eval = run_eval(steps_done) if heldout else {}
    tracker.close()
    samples.close()
    if cfg.run.save_model:
        save_final_model(model, tokenizer, run_dir / "model", cfg.model.lora)
        if value_model is not None:
            value_state = distributed.full_model_state(value_model, keep_tied=True)
            if distributed.is_main():  # a LoRA critic's adapters merged into its weights
                value_model.save(
                    run_dir / "value_model", state_dict=merged_state(value_model, value_state)
                )
    results = {
        "trainer": "policy_gradient",
        "steps": steps_done,
        "status": budget.status,  # complete | stopped_by_max_seconds
        "heldout_accuracy_before": initial_eval.get("accuracy"),
        "heldout_accuracy": final_eval.get("accuracy"),
        "heldout_accuracy_stderr": final_eval.get("accuracy_stderr"),
        "heldout_n": final_eval.get("n", 0),
        **majority_results(baseline),
        "heldout_overlap_dropped": splits.n_heldout_overlap_dropped,
        "heldout_metric": "accuracy" if cfg.data.source == "task" else "reward",
        "prompt_source": splits.source,
        "verifier_errors": verifier.n_errors,
        "health": health.summary(),
        "wall_s": round(time.perf_counter() - t_start, 2),
        "run_dir": str(run_dir),
        "model_dir": str(run_dir / "model") if cfg.run.save_model else None,
        "world_size": distributed.world_size(),
    }
    if distributed.is_main():
        plot_run(read_metrics(run_dir / "metrics.jsonl"), run_dir / "plots")
        write_json_atomic(run_dir / "final_results.json", results)
    distributed.barrier()
    return results


@torch.no_grad()
def _no_grad_logps(model, rollout, cfg: PGConfig, autocast_dtype) -> torch.Tensor:
    """(B, T) log-probs of the rollout under `model`, computed in micro-batches."""
    out = []
    for s in range(0, rollout.mask.size(0), cfg.train.micro_batch_size):
        micro = rollout.select(slice(s, s + cfg.train.micro_batch_size))
        logp, _ = completion_logps(
            model, micro, temperature=cfg.rollout.temperature, autocast_dtype=autocast_dtype
        )
        out.append(logp)
    return torch.cat(out)


@torch.no_grad()
def _no_grad_values(value_model, rollout, cfg: PGConfig, autocast_dtype) -> torch.Tensor:
    """(B, T) critic values of the rollout, computed in micro-batches."""
    out = []
    for s in range(0, rollout.mask.size(0), cfg.train.micro_batch_size):
        out.append(
            value_model(rollout.select(slice(s, s + cfg.train.micro_batch_size)), autocast_dtype)
        )
    return torch.cat(out)


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
    mm = mismatch_stats(logp, micro.logp, mask)
    add("rollout/logp_diff_mean", mm["logp_diff"].sum())
    add("rollout/sampler_kl", mm["sampler_kl"].sum())
    hi = mm["logp_diff"].max() if mask.numel() else torch.zeros(())
    sums["rollout/logp_diff_max"] = torch.maximum(sums.get("rollout/logp_diff_max", hi), hi)
    if "tis_weight" in stats:
        add("rollout/tis_weight_mean", (stats["tis_weight"] * mask).sum())
        add("rollout/tis_capped_frac", (stats["capped"] * mask).sum())
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
    default = {"ratio_max": float("-inf"), "ratio_min": float("inf"), "rollout/logp_diff_max": 0.0}
    out = {}
    for k in keys:
        v = sums.get(k, default.get(k, 0.0))
        # float64, as distributed.sum_dict: the same dtype on every rank, and a float64 run's
        # sums keep their precision
        if torch.is_tensor(v):
            v = v.detach().to(torch.float64).clone()
        else:
            v = torch.tensor(float(v), dtype=torch.float64)
        if k in ("ratio_max", "rollout/logp_diff_max"):
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
    for name, values in batch.components.items():
        values = values[~values.isnan()]  # a reward function's None entries are NaN
        if values.numel() == 0:  # no sample of the batch got this reward
            continue
        metrics[f"rollout/reward/{name}_mean"] = values.mean().item()
        metrics[f"rollout/reward/{name}_std"] = values.std().item() if values.numel() > 1 else 0.0
    return metrics

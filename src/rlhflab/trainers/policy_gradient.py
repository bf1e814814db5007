"""Policy-gradient RL with verifier rewards: GRPO and the family composed from named parts.

Each step reads top to bottom:
    1. rollout     sample `group_size` completions for each of `prompts_per_step` prompts
    2. rewards     score every completion with the task's verifier
    3. advantages  `loss.advantage` over the rewards (e.g. group z-score)
    4. old / ref   log-probs of the pre-update policy (only when more than one optimizer step uses
                   the batch) and of the reference policy (only when kl.coef > 0)
    5. update      update_epochs × minibatches optimizer steps; each accumulates micro-batches of
                   `loss.surrogate` + kl.coef · KL, reduced by `loss.aggregation` with denominators
                   counted once per optimizer step
    6. log         metrics (names in docs/metrics.md), samples every N steps, held-out eval
At the end: held-out evaluation, the model in HF format, plots and final_results.json.

The algorithm is the preset's composition (see configs/pg/*.yaml); this loop has no branch per
paper. On the first optimizer step of a batch, logp_old is the detached logp of the same forward,
so the ratio is exactly 1 there.
"""

from __future__ import annotations

import copy
import inspect
import random
import time

import torch

from rlhflab.config import PGConfig, dump_config
from rlhflab.data.formatting import encode_prompt, render_prompt
from rlhflab.data.tasks import make_splits
from rlhflab.eval.accuracy import evaluate
from rlhflab.losses.advantages import ADVANTAGES
from rlhflab.losses.aggregate import aggregate
from rlhflab.losses.kl import kl_penalty
from rlhflab.losses.policy import POLICY_LOSSES
from rlhflab.models.build import save_pretrained
from rlhflab.models.loading import context_length
from rlhflab.plots import plot_run
from rlhflab.rewards.verifier import Verifier
from rlhflab.rollout.sampler import completion_logps, decode_completions, sample
from rlhflab.runs import SampleWriter, create_run_dir, write_json_atomic, write_text_atomic
from rlhflab.tracking import Tracker, read_metrics
from rlhflab.trainers.common import (
    check_lengths,
    default_device,
    grad_norm_and_clip,
    make_optimizer,
    make_scheduler,
    prepare_model,
    seed_everything,
    setup_precision,
)
from rlhflab.trainers.sft import task_texts


def train(cfg: PGConfig) -> dict:
    """Run policy-gradient RL as configured; returns final results (also in final_results.json)."""
    t_start = time.perf_counter()
    # -- 0. Set-up: all validation happens here, before the run directory exists.
    seed_everything(cfg.seed)
    device = default_device()
    autocast_dtype = setup_precision(cfg.precision, device)
    t = cfg.task
    splits = make_splits(
        t.name, config=t.config, n_train=t.n_train, n_heldout=t.n_heldout, seed=t.seed
    )
    tokenizer, model = prepare_model(
        cfg.model,
        device=device,
        seed=cfg.seed,
        tokenizer_texts=lambda: task_texts(splits, cfg.model.build.tokenizer_texts),
    )
    prompts = [
        encode_prompt(tokenizer, render_prompt(tokenizer, p.question, system=t.system))
        for p in splits.train
    ]
    limit = context_length(model) - cfg.rollout.max_new_tokens
    check_lengths(
        [len(p) for p in prompts], limit, what="prompt", field=f"task '{t.name}' train split"
    )
    verifier = Verifier(answer_format=t.answer_format, reward=t.reward)
    heldout = splits.heldout[: cfg.eval.n]
    ref_model = None
    if cfg.kl.coef > 0:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    advantage_fn = ADVANTAGES[cfg.loss.advantage]
    advantage_kwargs = dict(cfg.loss.advantage_args)
    if "group_size" in inspect.signature(advantage_fn).parameters:
        advantage_kwargs["group_size"] = cfg.rollout.group_size
    surrogate_fn = POLICY_LOSSES[cfg.loss.surrogate]
    group_size = cfg.rollout.group_size
    batch_size = cfg.rollout.prompts_per_step * group_size
    minibatch_size = batch_size // cfg.train.minibatches
    optimizer_steps_per_batch = cfg.train.update_epochs * cfg.train.minibatches
    optimizer = make_optimizer(model, cfg.optim)
    scheduler = make_scheduler(optimizer, cfg.optim, cfg.train.steps * optimizer_steps_per_batch)
    sampler_rng = torch.Generator(device=device).manual_seed(cfg.seed)
    shuffle_rng = torch.Generator().manual_seed(cfg.seed + 1)
    prompt_rng = random.Random(cfg.seed)

    # -- 1. Run directory.
    run_dir = create_run_dir(cfg.run.root, cfg.run.name)
    write_text_atomic(run_dir / "config.yaml", dump_config(cfg))
    tracker = Tracker(
        run_dir,
        total_steps=cfg.train.steps,
        headline=("rollout/reward_mean", "policy/kl", "eval/accuracy"),
        console_enabled=cfg.tracking.console,
        wandb=cfg.tracking.wandb,
        tensorboard=cfg.tracking.tensorboard,
        config=cfg.model_dump(mode="json"),
        description=cfg.run.name,
    )
    samples = SampleWriter(run_dir)
    tracker.print(
        f"run directory: {run_dir}  (train prompts {len(prompts)}, held-out {len(heldout)}, "
        f"held-out dropped as seen in training: {splits.n_heldout_overlap_dropped})"
    )

    def run_eval(step: int) -> dict:
        res = evaluate(
            model,
            tokenizer,
            heldout,
            verifier,
            batch_size=cfg.eval.batch_size,
            max_new_tokens=cfg.eval.max_new_tokens,
            k=cfg.eval.k,
            temperature=cfg.eval.temperature,
            seed=cfg.seed,
            system=t.system,
            autocast_dtype=autocast_dtype,
        )
        tracker.log(step, {f"eval/{k}": v for k, v in res.items()})
        return res

    initial_eval = run_eval(0) if heldout else {}
    order: list[int] = []
    steps_done = 0
    for step in range(1, cfg.train.steps + 1):
        t0 = time.perf_counter()
        # -- 1. Rollout: prompts_per_step prompts, each repeated group_size times (group-contiguous).
        chosen = []
        while len(chosen) < cfg.rollout.prompts_per_step:
            if not order:
                order = list(range(len(prompts)))
                prompt_rng.shuffle(order)
            chosen.append(order.pop())
        problems = [splits.train[i] for i in chosen for _ in range(group_size)]
        model.eval()
        rollout = sample(
            model,
            [prompts[i] for i in chosen for _ in range(group_size)],
            max_new_tokens=cfg.rollout.max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            generator=sampler_rng,
            autocast_dtype=autocast_dtype,
        )
        model.train()
        t_rollout = time.perf_counter() - t0

        # -- 2. Rewards from the verifier.
        texts = decode_completions(tokenizer, rollout)
        rewards = torch.tensor(
            verifier.score_batch(texts, problems), dtype=torch.float32, device=device
        )

        # -- 3. Advantages (one per completion, broadcast over its tokens by the surrogate).
        adv = advantage_fn(rewards, **advantage_kwargs)

        # -- 4. Log-probs of the pre-update policy (if the batch feeds several optimizer steps) and
        #       of the reference policy (if KL is on), without gradients, in micro-batches.
        logp_old = (
            _no_grad_logps(model, rollout, cfg, autocast_dtype)
            if optimizer_steps_per_batch > 1
            else None
        )
        logp_ref = (
            _no_grad_logps(ref_model, rollout, cfg, autocast_dtype)
            if ref_model is not None
            else None
        )

        # -- 5. Update: update_epochs × minibatches optimizer steps over the rollout batch.
        sums: dict[str, torch.Tensor] = {}
        loss_total, grad_norms, first_step = 0.0, [], True
        for _epoch in range(cfg.train.update_epochs):
            perm = torch.randperm(batch_size, generator=shuffle_rng).to(device)
            for m in range(cfg.train.minibatches):
                mb_rows = perm[m * minibatch_size : (m + 1) * minibatch_size]
                # Denominators of this optimizer step, counted once over all its micro-batches.
                num_tokens = rollout.mask[mb_rows].sum()
                optimizer.zero_grad(set_to_none=True)
                for s in range(0, minibatch_size, cfg.train.micro_batch_size):
                    rows = mb_rows[s : s + cfg.train.micro_batch_size]
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
                    if logp_ref is not None:
                        kl_tok = kl_penalty(logp, logp_ref[rows], cfg.kl.estimator)
                        loss_tok = loss_tok + cfg.kl.coef * kl_tok
                        stats = {**stats, "kl": kl_tok.detach()}
                    loss = aggregate(
                        loss_tok,
                        micro.mask,
                        cfg.loss.aggregation,
                        num_tokens=num_tokens,
                        num_seqs=minibatch_size,
                        max_len=cfg.rollout.max_new_tokens,
                    )
                    loss.backward()
                    loss_total += float(loss.detach())
                    if first_step:  # diagnostics of the batch under the sampling policy
                        _accumulate(sums, micro, stats, entropy, logp.detach())
                grad_norms.append(grad_norm_and_clip(model, cfg.optim.max_grad_norm))
                optimizer.step()
                scheduler.step()
                first_step = False
        steps_done = step
        dt = time.perf_counter() - t0

        # -- 6. Log.
        metrics = _rollout_metrics(rewards, rollout, group_size)
        n_tok = sums.pop("tokens")
        metrics.update(
            {
                name: (value / n_tok).item()
                for name, value in sums.items()
                if name != "ratio_max" and name != "ratio_min"
            }
        )
        metrics["policy/ratio_max"] = sums["ratio_max"].item() if "ratio_max" in sums else 1.0
        metrics.update(
            {
                "policy/loss": loss_total / optimizer_steps_per_batch,
                "optim/grad_norm": torch.stack(grad_norms).mean().item(),
                "optim/lr": scheduler.get_last_lr()[0],
                "perf/step_s": dt,
                "perf/rollout_s": t_rollout,
                "perf/tokens_per_s": rollout.mask.sum().item() / dt,
                "verifier/errors": verifier.n_errors,
            }
        )
        if step % cfg.tracking.log_every == 0 or step == cfg.train.steps:
            tracker.log(step, metrics)
        if step % cfg.tracking.samples_every == 0 or step == 1:
            n = cfg.tracking.samples_per_step
            samples.write(
                step,
                [
                    {
                        "prompt": problems[i].question,
                        "completion": texts[i],
                        "reward": rewards[i].item(),
                        "answer": problems[i].answer,
                    }
                    for i in range(min(n, len(texts)))
                ],
            )
        if heldout and cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
            metrics.update({f"eval/{k}": v for k, v in run_eval(step).items()})
        tracker.advance(step, metrics)
        if cfg.train.max_seconds and time.perf_counter() - t_start > cfg.train.max_seconds:
            tracker.print(f"stopping at step {step}: train.max_seconds reached")
            break

    final_eval = run_eval(steps_done) if heldout else {}
    tracker.close()
    samples.close()
    if cfg.run.save_model:
        save_pretrained(model, tokenizer, run_dir / "model")
    plot_run(read_metrics(run_dir / "metrics.jsonl"), run_dir / "plots")
    results = {
        "trainer": "policy_gradient",
        "steps": steps_done,
        "heldout_accuracy_before": initial_eval.get("accuracy"),
        "heldout_accuracy": final_eval.get("accuracy"),
        "heldout_accuracy_stderr": final_eval.get("accuracy_stderr"),
        "heldout_n": final_eval.get("n", 0),
        "heldout_overlap_dropped": splits.n_heldout_overlap_dropped,
        "verifier_errors": verifier.n_errors,
        "wall_s": round(time.perf_counter() - t_start, 2),
        "run_dir": str(run_dir),
        "model_dir": str(run_dir / "model") if cfg.run.save_model else None,
    }
    write_json_atomic(run_dir / "final_results.json", results)
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


def _accumulate(sums: dict, micro, stats: dict, entropy, logp) -> None:
    """Masked sums of per-token diagnostics; divided by the step's token count when logged."""
    mask = micro.mask

    def add(name: str, value: torch.Tensor) -> None:
        sums[name] = sums.get(name, 0.0) + value

    add("tokens", mask.sum())
    add("policy/entropy", (entropy * mask).sum())
    add("policy/ratio_mean", (stats["ratio"] * mask).sum())
    add("policy/clip_frac_low", (stats["clipped_low"] * mask).sum())
    add("policy/clip_frac_high", (stats["clipped_high"] * mask).sum())
    add("rollout/logp_diff", ((logp - micro.logp).abs() * mask).sum())
    if "kl" in stats:
        add("policy/kl", (stats["kl"] * mask).sum())
    ratio_max = (stats["ratio"] * mask).max()
    sums["ratio_max"] = torch.maximum(sums.get("ratio_max", ratio_max), ratio_max)


def _rollout_metrics(rewards: torch.Tensor, rollout, group_size: int) -> dict:
    """Reward, accuracy, length and truncation statistics of one rollout batch."""
    grouped = rewards.view(-1, group_size)
    lengths = rollout.lengths
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        "rollout/accuracy": (rewards == 1.0).float().mean().item(),
        "rollout/response_len_mean": lengths.mean().item(),
        "rollout/response_len_max": lengths.max().item(),
        "rollout/truncated_frac": rollout.truncated.float().mean().item(),
        "rollout/zero_std_group_frac": (grouped.std(1) == 0).float().mean().item()
        if group_size > 1
        else 0.0,
    }

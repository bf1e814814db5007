"""Supervised fine-tuning: prompt-masked cross-entropy on (prompt, completion) pairs.

    loss = − Σ_{i,t} mask_{i,t} · log π_θ(y_{i,t} | x_i, y_{i,<t}) / N_tokens

N_tokens counts the trained tokens of the whole optimizer step (all micro-batches), so k
micro-batches give exactly the gradient of one batch. Prompt tokens carry no loss. Pairs come
from a reasoning_gym task (question → answer in the configured answer format) or a dataset
(`text`, `messages` or `prompt`/`completion` rows; rlhflab.data.sft). A multi-turn `messages`
row trains every assistant turn (data.assistant_turns "all"): mask is 0 on the user turns between
them; a `text` row trains every token.

Phases: 0 set-up and validation (nothing written yet) → 1 run directory → held-out evaluation
at step 0 → 2 training steps → 3 held-out evaluation → 4 save model, plots, final_results.json.
"""

from __future__ import annotations

import random
import time

import torch

from rlhflab import distributed, faults
from rlhflab.checkpoint import Checkpointer, StopSignals
from rlhflab.config import SFTConfig
from rlhflab.data.formatting import task_instruction
from rlhflab.data.sft import load_sft_data, sft_examples_from_problems, split_features, tokenize_sft
from rlhflab.data.tasks import make_splits, task_texts
from rlhflab.eval.accuracy import majority_baseline, majority_results
from rlhflab.fingerprint import data_fingerprint
from rlhflab.health import HealthMonitor
from rlhflab.losses.aggregate import aggregate
from rlhflab.models.loading import context_length
from rlhflab.models.lora import apply_lora
from rlhflab.plots import plot_run
from rlhflab.rewards.verifier import Verifier
from rlhflab.rollout.sampler import completion_logps, pack
from rlhflab.runs import write_json_atomic
from rlhflab.tracking import Tracker, read_metrics
from rlhflab.trainers.common import (
    NonFiniteGuard,
    ShuffledStream,
    TimeBudget,
    default_device,
    grad_norm_and_clip,
    heldout_eval,
    make_optimizer,
    make_scheduler,
    open_run,
    prepare_model,
    resume_point,
    save_final_model,
    seed_everything,
    setup_precision,
)


def train(cfg: SFTConfig) -> dict:
    """Run SFT as configured; returns the final results dict (also in final_results.json)."""
    t_start = time.perf_counter()
    # -- 0. Set-up: everything that can fail on bad input fails here, before any file is written.
    ckpt = resume_point(cfg)  # the verified checkpoint to continue from, or None
    seed_everything(cfg.seed)
    device = default_device()
    autocast_dtype = setup_precision(cfg.precision, device)
    needs_task = cfg.data.source == "task" or cfg.model.build is not None or cfg.eval.n > 0
    splits = None
    if needs_task:
        t = cfg.task
        splits = make_splits(
            t.name, config=t.config, n_train=t.n_train, n_heldout=t.n_heldout, seed=t.seed
        )
    tokenizer, model = prepare_model(
        cfg.model,
        device=device,
        seed=cfg.seed,
        tokenizer_texts=lambda: task_texts(splits, cfg.model.build.tokenizer_texts),
        sharded_later=True,
    )
    if cfg.data.source == "task":
        examples = sft_examples_from_problems(
            splits.train,
            tokenizer,
            answer_format=cfg.task.answer_format,
            system=cfg.task.system,
            instruction=task_instruction(cfg.task),
        )
        drops: dict[str, int] = {}
    else:
        examples, drops = load_sft_data(
            cfg.data.path,
            tokenizer,
            split=cfg.data.split,
            on_invalid=cfg.data.on_invalid,
            assistant_turns=cfg.data.assistant_turns,
        )
    max_len = min(cfg.train.max_len, context_length(model))
    features = tokenize_sft(
        tokenizer, examples, max_len=max_len, on_invalid=cfg.data.on_invalid, drops=drops
    )
    # (prompt ids, completion ids, loss mask): the prompt ends before the first trained token;
    # the mask is 0 on the untrained context of later turns inside the completion.
    pairs = [split_features(f) for f in features]
    verifier = Verifier(
        answer_format=cfg.task.answer_format, reward=cfg.task.reward, extractor=cfg.task.extractor
    )
    heldout = splits.heldout[: cfg.eval.n] if splits is not None and cfg.eval.n > 0 else []
    # Beside the accuracy: the most common training answer given to every held-out problem.
    baseline = majority_baseline(splits.train, heldout, verifier) if heldout else None
    distributed.check_split(cfg.train.batch_size, "train.batch_size", "rows")
    model = apply_lora(model, cfg.model.lora)  # model.lora unset: unchanged
    model = distributed.wrap(model, cfg.parallel)  # one process: unchanged
    optimizer = make_optimizer(model, cfg.optim)
    scheduler = make_scheduler(optimizer, cfg.optim, cfg.train.steps)

    # -- 1. Run directory (a resumed run continues in its own).
    run_dir = open_run(cfg, ckpt)
    tracker = Tracker.for_run(run_dir, cfg, headline=("train/loss", "eval/accuracy"), ckpt=ckpt)
    tracker.print(f"run directory: {run_dir}  ({len(pairs)} examples, dropped: {drops or 0})")
    health = HealthMonitor(cfg.health, model, print_fn=tracker.warn)

    def run_eval(step: int) -> dict:
        return heldout_eval(
            cfg, model, tokenizer, heldout, verifier, tracker, step, autocast_dtype,
            baseline=baseline,
        )  # fmt: skip

    # -- 2. Training steps: shuffled epochs over the pairs, batch_size pairs per optimizer step,
    #       drawn in one global order; each data-parallel rank trains on its contiguous share.
    #       Checkpoints hold model, optimizer, schedule, RNGs and the data position (`order`).
    stream = ShuffledStream(
        len(pairs), random.Random(cfg.seed),
        # single-turn rows keep the (prompt, completion) fingerprint of earlier versions
        fingerprint=data_fingerprint([p[:2] if all(p[2]) else p for p in pairs]),
        allow_change=cfg.run.allow_config_change,
    )  # fmt: skip
    last_loss = float("nan")
    guard = NonFiniteGuard(cfg.train.nan_policy, cfg.train.nan_max_skips)
    checkpointer = Checkpointer(
        run_dir,
        cfg.model_dump(mode="json"),
        modules={"model": model},
        optimizers={"optimizer": optimizer},
        schedulers={"scheduler": scheduler},
        stateful={"data": stream, "nan": guard, "health": health, "tracker": tracker},
        every=cfg.checkpoint.every,
        keep_last=cfg.checkpoint.keep_last,
        resumed_from=ckpt,
        tokenizer=tokenizer,
    )

    def state() -> dict:
        return {"last_loss": last_loss, "initial_eval": initial_eval}

    if ckpt is not None:
        st = checkpointer.resume(ckpt, tracker, cfg.train.steps)
        last_loss = st["last_loss"]
        initial_eval = st.get("initial_eval", {})  # checkpoints before it: unknown
    else:
        # Step 0, like the RL trainers: the held-out accuracy before training. Greedy decoding
        # draws from no generator, so the training stream (data order, RNGs) is unchanged.
        initial_eval = run_eval(0) if heldout else {}
    steps_done = ckpt.step if ckpt is not None else 0
    budget = TimeBudget(cfg.train.max_seconds, cfg.train.steps, t_start)
    with StopSignals() as stop:  # SIGTERM / SIGINT: finish the step, checkpoint, exit
        for step in range(steps_done + 1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            batch_idx = stream.take(cfg.train.batch_size)  # the global batch
            # Denominator: trained tokens of the whole global step (all ranks, all
            # micro-batches), counted once before the micro-batches.
            num_tokens = sum(sum(pairs[i][2]) for i in batch_idx)
            local_idx = distributed.shard(batch_idx)
            optimizer.zero_grad(set_to_none=True)
            step_loss = torch.zeros((), dtype=torch.float64)  # the step's loss, summed exactly
            for s in range(0, len(local_idx), cfg.train.micro_batch_size):
                idx = local_idx[s : s + cfg.train.micro_batch_size]
                mb = pack(
                    [pairs[i][0] for i in idx], [pairs[i][1] for i in idx], tokenizer.pad_token_id
                )
                mb = mb.to(device)
                loss_mask = mb.mask.clone()  # (B, T): 1 on trained completion tokens
                for r, i in enumerate(idx):
                    loss_mask[r, : len(pairs[i][2])] = torch.tensor(pairs[i][2])
                logp, _ = completion_logps(model, mb, autocast_dtype=autocast_dtype)
                loss = aggregate(-logp, loss_mask, "token_mean", num_tokens=num_tokens)
                loss = faults.corrupt("loss", step, loss)
                loss.backward()
                step_loss += loss.detach().cpu()
            faults.hit("step_mid", step)
            step_loss = distributed.all_reduce_sum(step_loss)  # the global batch's loss
            grad_norm = grad_norm_and_clip(model, cfg.optim.max_grad_norm)
            if guard.check(step, {"train/loss": step_loss, "optim/grad_norm": grad_norm}):
                optimizer.step()
                scheduler.step()
            steps_done = step
            last_loss = float(step_loss)
            dt = time.perf_counter() - t0
            metrics = {
                "train/loss": last_loss,
                "optim/grad_norm": float(grad_norm),
                "optim/lr": scheduler.get_last_lr()[0],
                "perf/step_s": dt,
                "perf/tokens_per_s": num_tokens / dt,
            }
            if cfg.train.nan_policy == "skip":
                metrics["train/nan_skips"] = guard.skipped
            metrics.update(health.check(step, metrics, sample=mb))
            if step % cfg.tracking.log_every == 0 or step == cfg.train.steps:
                tracker.log(step, metrics)
            if heldout and cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
                metrics.update({f"eval/{k}": v for k, v in run_eval(step).items()})
            tracker.advance(step, metrics)
            checkpointer.end_step(step, stop, state, on_stop=(tracker.close,), halt=health.halt())
            if budget.expired(step):  # per invocation; never after the last step
                break
    budget.say_stop(tracker)
    checkpointer.finish(steps_done, state(), stopped=budget.stopped_at is not None)

    # -- 3. Held-out evaluation.
    final_eval = run_eval(steps_done) if heldout else {}

    # -- 4. Save model, plots, results.
    tracker.close()
    if cfg.run.save_model:
        save_final_model(model, tokenizer, run_dir / "model", cfg.model.lora)
    results = {
        "trainer": "sft",
        "steps": steps_done,
        "status": budget.status,  # complete | stopped_by_max_seconds
        "final_loss": last_loss,
        "examples": len(pairs),
        "dropped": drops,
        "heldout_accuracy_before": initial_eval.get("accuracy"),
        "heldout_accuracy": final_eval.get("accuracy"),
        "heldout_accuracy_stderr": final_eval.get("accuracy_stderr"),
        "heldout_n": final_eval.get("n", 0),
        **majority_results(baseline),
        "heldout_overlap_dropped": splits.n_heldout_overlap_dropped if splits else None,
        "health": health.summary(),
        "wall_s": round(time.perf_counter() - t_start, 2),
        "run_dir": str(run_dir),
        "model_dir": str(run_dir / "model") if cfg.run.save_model else None,
        "world_size": distributed.world_size(),
    }
    if distributed.is_main():
        plot_run(read_metrics(run_dir / "metrics.jsonl"), run_dir / "plots")
        write_json_atomic(run_dir / "final_results.json", results)
    return results

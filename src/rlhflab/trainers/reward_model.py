"""Reward-model training: Bradley–Terry preference RM, outcome RM (ORM) and process RM (PRM).

    preference  loss = Σ_pairs −log σ(r(x, y_c) − r(x, y_r) − m) + η(r_c + r_r)²  / N_pairs
    orm         loss = Σ_{i,t} BCE(σ(z_{i,t}), y_i) / N_completion_tokens     (orm_bce)
                       or Σ_i BCE(σ(z_i,last), y_i) / N_sequences                (orm_seq_bce)
    prm         loss = Σ_{separators} CE(z_{i,t}, c_{i,t}) / N_steps

Denominators are counted once per optimizer step over all its micro-batches, so k micro-batches
give the gradient of one batch. The model is a `*ForSequenceClassification` built from the causal
LM in `model` (its backbone, a fresh linear head; `rlhflab.models.reward`), scored at the last real
token (preference, ORM) or at the step separators (PRM).

Data (`data.source`): a policy's own samples of task prompts labelled by the verifier (pairs of
correct ≻ incorrect, outcomes, or checked steps), planted-error arithmetic worked solutions, a
preference dataset (UltraFeedback / HH-RLHF / generic pairs) or PRM800K. Task-derived evaluation
data comes from the held-out split (questions never seen in training); file data holds out the last
`data.heldout_frac` of its rows.

Phases: 0 set-up, data and validation (nothing written yet) → 1 run directory → 2 training steps →
3 held-out RM metrics (+ best-of-N when eval.best_of_n is set) → 4 save model, plots, results.
"""

from __future__ import annotations

import random
import time

import torch

from rlhflab import distributed, faults
from rlhflab.checkpoint import Checkpointer, StopSignals
from rlhflab.config import RMConfig
from rlhflab.data.formatting import task_instruction
from rlhflab.data.reward_data import (
    LabelledCompletion,
    StepLabelledCompletion,
    truncate_items,
)
from rlhflab.data.tasks import make_splits, task_texts
from rlhflab.errors import DataError
from rlhflab.fingerprint import data_fingerprint
from rlhflab.health import HealthMonitor
from rlhflab.losses.reward_model import (
    IGNORE_INDEX,
    bradley_terry,
    orm_bce,
    orm_seq_bce,
    prm_step_ce,
)
from rlhflab.models.loading import context_length
from rlhflab.models.lora import apply_lora, merged_state
from rlhflab.models.reward import (
    completion_token_logits,
    ensure_distinct_pad,
    reward_head,
    reward_model_from_causal_lm,
    save_reward_model,
    score_rollout,
)
from rlhflab.plots import plot_run
from rlhflab.rewards.verifier import Verifier
from rlhflab.rollout.sampler import pack
from rlhflab.runs import write_json_atomic
from rlhflab.tracking import Tracker, read_metrics
from rlhflab.trainers.common import (
    NonFiniteGuard,
    ShuffledStream,
    TimeBudget,
    default_device,
    grad_norm_and_clip,
    make_optimizer,
    make_scheduler,
    open_run,
    prepare_model,
    resume_point,
    seed_everything,
    setup_precision,
)


def train(cfg: RMConfig) -> dict:
    """Train a reward model as configured; returns final results (also in final_results.json)."""
    t_start = time.perf_counter()
    # -- 0. Set-up: model, data, validation. Nothing is written before this phase ends.
    ckpt = resume_point(cfg)  # the verified checkpoint to continue from, or None
    seed_everything(cfg.seed)
    device = default_device()
    autocast_dtype = setup_precision(cfg.precision, device)
    d = cfg.data
    needs_task = d.source in ("task_samples", "worked_solutions") or cfg.model.build is not None
    splits = None
    if needs_task:
        t = cfg.task
        splits = make_splits(
            t.name,
            config=t.config,
            n_train=max(t.n_train, d.n_prompts),
            n_heldout=cfg.eval.n_problems,
            seed=t.seed,
        )
    tokenizer, lm = prepare_model(
        cfg.model,
        device=device,
        seed=cfg.seed,
        tokenizer_texts=lambda: task_texts(splits, cfg.model.build.tokenizer_texts),
        sharded_later=True,  # the LM gives its config and weights to the RM; used after wrap
    )
    num_labels = cfg.loss.num_classes if cfg.kind == "prm" else 1
    sep_id = None
    if cfg.kind == "prm":
        from rlhflab.data.prm import separator_id

        sep_id = separator_id(tokenizer, d.step_separator)
    max_len = min(d.max_len, context_length(lm))
    train_items, eval_items, data_counts = build_rm_data(cfg, tokenizer, lm, splits, device)
    train_items, trunc = truncate_items(train_items, max_len)
    eval_items, _ = truncate_items(eval_items, max_len)
    data_counts["truncation"] = trunc
    if not train_items:
        raise DataError(f"data: no {cfg.kind} training examples ({data_counts})")
    model = reward_model_from_causal_lm(
        lm, num_labels=num_labels, seed=cfg.seed, pad_token_id=tokenizer.pad_token_id
    )
    ensure_distinct_pad(model, tokenizer)  # pad == eos: plain transformers would pool elsewhere
    del lm
    # model.lora: adapters on the backbone, the score head trained in full beside them
    model = apply_lora(model, cfg.model.lora, keep_trainable=[reward_head(model)])
    model.train()
    distributed.check_split(cfg.train.batch_size, "train.batch_size", "examples")
    # one process: unchanged; under FSDP2 the backbone and the score head are sharded as two
    # roots, because the scorer calls them one after the other (rlhflab.models.reward)
    model = distributed.wrap(model, cfg.parallel, roots=[model.base_model, reward_head(model)])
    optimizer = make_optimizer(model, cfg.optim)
    scheduler = make_scheduler(optimizer, cfg.optim, cfg.train.steps)

    # -- 1. Run directory (a resumed run continues in its own).
    run_dir = open_run(cfg, ckpt)
    tracker = Tracker.for_run(run_dir, cfg, headline=("train/loss", "rm/accuracy"), ckpt=ckpt)
    health = HealthMonitor(cfg.health, model, print_fn=tracker.warn)
    tracker.print(
        f"run directory: {run_dir}  ({len(train_items)} train / {len(eval_items)} held-out "
        f"{cfg.kind} examples; data: {data_counts})"
    )

    # -- 2. Training steps. Checkpoints hold model, optimizer, schedule, RNGs and the data
    #       position (the data itself is rebuilt exactly by the set-up).
    stream = ShuffledStream(
        len(train_items), random.Random(cfg.seed), fingerprint=data_fingerprint(train_items),
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
        return {"last_loss": last_loss}

    steps_done = ckpt.step if ckpt is not None else 0
    if ckpt is not None:
        last_loss = checkpointer.resume(ckpt, tracker, cfg.train.steps)["last_loss"]
    budget = TimeBudget(cfg.train.max_seconds, cfg.train.steps, t_start)
    with StopSignals() as stop:  # SIGTERM / SIGINT: finish the step, checkpoint, exit
        for step in range(steps_done + 1, cfg.train.steps + 1):
            t0 = time.perf_counter()
            batch = [train_items[i] for i in stream.take(cfg.train.batch_size)]  # global batch
            # counted once for the whole optimizer step, over the global batch (every rank)
            denom = loss_denominator(cfg, batch)
            local = distributed.shard(batch)  # this rank's contiguous share
            optimizer.zero_grad(set_to_none=True)
            step_loss = torch.zeros((), dtype=torch.float64)  # the step's loss, summed exactly
            acc_sum = acc_n = 0.0
            for s in range(0, len(local), cfg.train.micro_batch_size):
                mb = local[s : s + cfg.train.micro_batch_size]
                losses, weight, stats = rm_losses(
                    cfg, model, mb, tokenizer.pad_token_id, device, autocast_dtype
                )
                loss = losses.sum() / denom
                loss = faults.corrupt("loss", step, loss)
                loss.backward()
                step_loss += loss.detach().cpu()
                acc_sum += float((stats["accuracy"] * weight).sum())
                acc_n += float(weight.sum())
            faults.hit("step_mid", step)
            step_loss = distributed.all_reduce_sum(step_loss)
            acc = distributed.sum_dict({"sum": acc_sum, "n": acc_n})
            acc_sum, acc_n = acc["sum"], acc["n"]
            grad_norm = grad_norm_and_clip(model, cfg.optim.max_grad_norm)
            if guard.check(step, {"train/loss": step_loss, "optim/grad_norm": grad_norm}):
                optimizer.step()
                scheduler.step()
            steps_done = step
            last_loss = float(step_loss)
            metrics = {
                "train/loss": last_loss,
                "rm/accuracy": acc_sum / max(acc_n, 1.0),
                "optim/grad_norm": float(grad_norm),
                "optim/lr": scheduler.get_last_lr()[0],
                "perf/step_s": time.perf_counter() - t0,
            }
            if cfg.train.nan_policy == "skip":
                metrics["train/nan_skips"] = guard.skipped
            metrics.update(health.check(step, metrics))
            if step % cfg.tracking.log_every == 0 or step == cfg.train.steps:
                tracker.log(step, metrics)
            tracker.advance(step, metrics)
            checkpointer.end_step(step, stop, state, on_stop=(tracker.close,), halt=health.halt())
            if budget.expired(step):  # per invocation; never after the last step
                break
    budget.say_stop(tracker)
    checkpointer.finish(steps_done, state(), stopped=budget.stopped_at is not None)

    # -- 3. Held-out RM metrics (and best-of-N with the sampling policy).
    model.eval()
    with distributed.gathered(model):  # every rank scores every held-out example
        final_eval = (
            evaluate_rm(cfg, model, eval_items, tokenizer.pad_token_id, device, autocast_dtype)
            if eval_items
            else {}
        )
    if final_eval:
        tracker.log(steps_done, {f"eval/{k}": v for k, v in final_eval.items()})
    bon = {}
    if cfg.eval.best_of_n and splits is not None and d.source == "task_samples":
        from rlhflab.eval.best_of_n import best_of_n_eval
        from rlhflab.rewards.reward_model import RewardModelScorer

        scorer = RewardModelScorer(
            model,
            kind=cfg.kind,
            pad_token_id=tokenizer.pad_token_id,
            sep_id=sep_id,
            prm_reduce=cfg.loss.prm_reduce,
            autocast_dtype=autocast_dtype,
        )
        policy = _policy(cfg, device)
        with distributed.gathered(model):  # every rank runs it (the same draws)
            bon = best_of_n_eval(
                policy,
                tokenizer,
                splits.heldout[: cfg.eval.n_problems],
                Verifier(
                    answer_format=cfg.task.answer_format,
                    reward=cfg.task.reward,
                    extractor=cfg.task.extractor,
                ),
                {cfg.kind: scorer},
                ns=cfg.eval.best_of_n,
                max_new_tokens=cfg.eval.max_new_tokens,
                temperature=cfg.eval.temperature,
                batch_size=cfg.eval.batch_size,
                seed=cfg.seed + 7,
                system=cfg.task.system,
                instruction=task_instruction(cfg.task),
            )

    # -- 4. Save model, plots, results.
    tracker.close()
    if cfg.run.save_model:
        state = distributed.full_model_state(model, keep_tied=True)
        if distributed.is_main():
            merged = merged_state(model, state)  # LoRA: adapters folded in; else `state`
            save_reward_model(model, tokenizer, run_dir / "model", state_dict=merged)
    results = {
        "trainer": "reward_model",
        "kind": cfg.kind,
        "steps": steps_done,
        "status": budget.status,  # complete | stopped_by_max_seconds
        "final_loss": last_loss,
        "train_examples": len(train_items),
        "eval_examples": len(eval_items),
        "data": data_counts,
        "eval": final_eval,
        "best_of_n": bon.get("curves") if bon else None,
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


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

_POLICIES: dict = {}


def _policy(cfg: RMConfig, device):
    """The sampling policy: data.policy, or the backbone checkpoint (model.name_or_path)."""
    from rlhflab.models.loading import load_model

    path = cfg.data.policy or cfg.model.name_or_path
    key = (path, str(device))
    if key not in _POLICIES:
        _POLICIES.clear()
        _POLICIES[key] = load_model(path, device=device).eval()
    return _POLICIES[key]


def build_rm_data(cfg: RMConfig, tokenizer, lm, splits, device) -> tuple[list, list, dict]:
    """(train items, held-out items, counts) for `cfg.kind` from `cfg.data.source`."""
    d, kind = cfg.data, cfg.kind
    if d.source == "task_samples":
        from rlhflab.data.prm import separator_id
        from rlhflab.data.reward_data import (
            orm_from_samples,
            pairs_from_samples,
            prm_from_samples,
        )
        from rlhflab.rollout.scored import sample_and_score

        policy = _policy(cfg, device)
        verifier = Verifier(
            answer_format=cfg.task.answer_format,
            reward=cfg.task.reward,
            extractor=cfg.task.extractor,
        )
        out, counts = [], {}
        for name, problems, seed in (
            ("train", splits.train[: d.n_prompts], cfg.seed),
            ("heldout", splits.heldout[: cfg.eval.n_problems], cfg.seed + 1),
        ):
            ss = sample_and_score(
                policy,
                tokenizer,
                problems,
                verifier,
                k=d.samples_per_prompt,
                max_new_tokens=d.max_new_tokens,
                temperature=d.temperature,
                seed=seed,
                system=cfg.task.system,
                instruction=task_instruction(cfg.task),
            )
            flat = [s for row in ss.scores for s in row]
            counts[f"{name}_sample_accuracy"] = sum(s >= 1.0 for s in flat) / max(1, len(flat))
            if kind == "preference":
                items, c = pairs_from_samples(
                    ss, max_pairs_per_prompt=d.max_pairs_per_prompt, seed=seed
                )
            elif kind == "orm":
                items, c = orm_from_samples(ss), {"completions": len(flat)}
            else:
                sep_id = separator_id(tokenizer, d.step_separator)
                items, c = prm_from_samples(
                    ss, tokenizer, sep_id=sep_id, num_classes=cfg.loss.num_classes
                )
            counts[name] = c
            out.append(items)
        return out[0], out[1], counts
    if d.source == "worked_solutions":
        from rlhflab.data.prm import tokenize_prm, worked_solution_examples

        out, counts = [], {}
        for name, problems, seed in (
            ("train", splits.train[: d.n_prompts], cfg.seed),
            ("heldout", splits.heldout[: cfg.eval.n_problems], cfg.seed + 1),
        ):
            exs, c = worked_solution_examples(
                problems, tokenizer, error_frac=d.error_frac, seed=seed, sep=d.step_separator
            )
            counts[name] = c
            items = []
            for i, ex in enumerate(exs):
                p, comp, labels = tokenize_prm(
                    tokenizer, ex, num_classes=cfg.loss.num_classes, sep=d.step_separator, row=i
                )
                if kind == "prm":
                    items.append(StepLabelledCompletion(p, comp, labels))
                else:
                    items.append(
                        LabelledCompletion(p, comp, float(all(r == 1 for r in ex.ratings)))
                    )
            out.append(items)
        return out[0], out[1], counts
    if d.source == "preference":
        from rlhflab.data.preference import (
            UnpairedExample,
            load_preference_data,
            tokenize_pairs,
        )

        pairs, drops = load_preference_data(
            d.path, d.format, split=d.split, on_invalid=d.on_invalid, max_rows=d.max_rows
        )
        if isinstance(pairs[0], UnpairedExample):
            raise DataError(f"data.path: {d.path} holds unpaired rows (prompt, completion, "
                            "label); a preference reward model needs chosen/rejected pairs")  # fmt: skip
        items, tcounts = tokenize_pairs(tokenizer, pairs)
        return (*_split_rows(items, d.heldout_frac), {"dropped": drops, **tcounts})
    # prm800k
    from rlhflab.data.prm import load_prm800k, tokenize_prm

    exs, drops = load_prm800k(
        d.path,
        tokenizer,
        split=d.split,
        on_invalid=d.on_invalid,
        sep=d.step_separator,
        limit=d.max_rows,
    )
    items = []
    for i, ex in enumerate(exs):
        p, comp, labels = tokenize_prm(
            tokenizer, ex, num_classes=cfg.loss.num_classes, sep=d.step_separator, row=i
        )
        items.append(StepLabelledCompletion(p, comp, labels))
    return (*_split_rows(items, d.heldout_frac), {"dropped": drops})


def _split_rows(items: list, heldout_frac: float) -> tuple[list, list]:
    n_eval = int(len(items) * heldout_frac)
    return items[: len(items) - n_eval], items[len(items) - n_eval :]


# ---------------------------------------------------------------------------------------------
# Loss of a micro-batch
# ---------------------------------------------------------------------------------------------


def loss_denominator(cfg: RMConfig, batch: list) -> float:
    """Pairs (preference), completion tokens (orm_bce), sequences (orm_seq_bce), steps (prm)."""
    if cfg.kind == "preference" or (cfg.kind == "orm" and cfg.loss.orm_loss == "orm_seq_bce"):
        return float(len(batch))
    if cfg.kind == "orm":
        return float(sum(len(it.completion_ids) for it in batch))
    return float(max(1, sum(sum(lab != IGNORE_INDEX for lab in it.labels) for it in batch)))


def _pad_labels(items: list[StepLabelledCompletion], width: int) -> torch.Tensor:
    out = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
    for i, it in enumerate(items):
        out[i, : len(it.labels)] = torch.tensor(it.labels, dtype=torch.long)
    return out


def rm_losses(cfg: RMConfig, model, mb: list, pad_id: int, device, autocast_dtype):
    """Un-reduced losses of a micro-batch, the weight of each accuracy entry, and stats."""
    if cfg.kind == "preference":
        ro = pack(
            [it.prompt_ids for it in mb] * 2,
            [it.chosen_ids for it in mb] + [it.rejected_ids for it in mb],
            pad_id,
        ).to(device)
        scores = score_rollout(model, ro, autocast_dtype=autocast_dtype)
        r_c, r_r = scores[: len(mb)], scores[len(mb) :]
        losses, stats = bradley_terry(
            r_c, r_r, margin=cfg.loss.margin, center_coef=cfg.loss.center_coef
        )
        return losses, torch.ones_like(losses), stats
    ro = pack([it.prompt_ids for it in mb], [it.completion_ids for it in mb], pad_id).to(device)
    if cfg.kind == "orm":
        labels = torch.tensor([it.label for it in mb], device=device)
        if cfg.loss.orm_loss == "orm_seq_bce":
            losses, stats = orm_seq_bce(
                score_rollout(model, ro, autocast_dtype=autocast_dtype), labels
            )
            return losses, torch.ones_like(losses), stats
        logits = completion_token_logits(model, ro, autocast_dtype=autocast_dtype)[..., 0]
        losses, stats = orm_bce(logits, labels, ro.mask)
        return losses, ro.mask, stats
    logits = completion_token_logits(model, ro, autocast_dtype=autocast_dtype)
    labels = _pad_labels(mb, ro.completion_ids.size(1)).to(device)
    losses, stats = prm_step_ce(logits, labels)
    return losses, stats["step_mask"], stats


# ---------------------------------------------------------------------------------------------
# Held-out metrics
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_rm(cfg: RMConfig, model, items: list, pad_id: int, device, autocast_dtype) -> dict:
    """Preference: accuracy, margin, chosen/rejected means, ECE. ORM: accuracy, AUC, ECE of the
    final-token P(correct). PRM: step accuracy, first-error detection, step AUC, and the solution
    AUC of min/prod step scores against "every step correct"."""
    from rlhflab.eval.rm_metrics import auc, outcome_metrics, preference_metrics, prm_metrics
    from rlhflab.losses.reward_model import prm_solution_score, prm_step_correct_prob

    bs = cfg.train.micro_batch_size
    if cfg.kind == "preference":
        rc, rr = [], []
        for s in range(0, len(items), bs):
            mb = items[s : s + bs]
            ro = pack(
                [it.prompt_ids for it in mb] * 2,
                [it.chosen_ids for it in mb] + [it.rejected_ids for it in mb],
                pad_id,
            ).to(device)
            sc = score_rollout(model, ro, autocast_dtype=autocast_dtype).tolist()
            rc += sc[: len(mb)]
            rr += sc[len(mb) :]
        return preference_metrics(rc, rr)
    if cfg.kind == "orm":
        probs, labels = [], []
        for s in range(0, len(items), bs):
            mb = items[s : s + bs]
            ro = pack([it.prompt_ids for it in mb], [it.completion_ids for it in mb], pad_id)
            probs += torch.sigmoid(score_rollout(model, ro.to(device))).tolist()
            labels += [it.label for it in mb]
        return outcome_metrics(probs, labels)
    step_probs, step_ok, sol_scores, sol_ok = [], [], [], []
    correct_class = cfg.loss.num_classes - 1
    for s in range(0, len(items), bs):
        mb = items[s : s + bs]
        ro = pack([it.prompt_ids for it in mb], [it.completion_ids for it in mb], pad_id).to(device)
        p = prm_step_correct_prob(completion_token_logits(model, ro, autocast_dtype=autocast_dtype))
        labels = _pad_labels(mb, ro.completion_ids.size(1)).to(device)
        steps = labels != IGNORE_INDEX
        sol = prm_solution_score(p, steps, reduce=cfg.loss.prm_reduce)
        for i in range(len(mb)):
            m = steps[i]
            step_probs.append(p[i][m].tolist())
            ok = (labels[i][m] == correct_class).tolist()
            step_ok.append(ok)
            sol_scores.append(float(sol[i]))
            sol_ok.append(1.0 if all(ok) else 0.0)
    out = prm_metrics(step_probs, step_ok)
    out["solution_auc"] = auc(sol_scores, sol_ok)
    return out

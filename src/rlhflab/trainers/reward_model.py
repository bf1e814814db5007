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

The run's life (run directory, resume, checkpoints, stop signals, results) is the harness's
(rlhflab.trainers.loop); this module is the set-up and data, one optimizer step, the held-out RM
metrics (+ best-of-N when eval.best_of_n is set) at the end, and the saved reward model.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from rlhflab import distributed, faults
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
from rlhflab.rewards.verifier import Verifier
from rlhflab.rollout.sampler import pack
from rlhflab.trainers.common import (
    ShuffledStream,
    grad_norm_and_clip,
    make_optimizer,
    make_scheduler,
    micro_batches,
    prepare_model,
)
from rlhflab.trainers.loop import Checkpointed, Env, Trainer, run


def train(cfg: RMConfig) -> dict:
    """Train a reward model as configured; returns final results (also in final_results.json)."""
    return run(cfg, RewardModelTrainer)


class RewardModelTrainer(Trainer):
    """Reward-model training under the run harness (rlhflab.trainers.loop): set-up (data, the
    sequence-classification model), one optimizer step, the held-out RM metrics and best-of-N
    at the end, the reward model saved as a `*ForSequenceClassification` directory."""

    name = "reward_model"
    headline = ("train/loss", "rm/accuracy")

    def __init__(self, cfg: RMConfig, env: Env) -> None:
        """Set-up: model, data, validation. Nothing is written.

        Raises:
            DataError: no training examples (and what `build_rm_data` raises).
        """
        super().__init__(cfg, env)
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
        self.splits = splits
        tokenizer, lm = prepare_model(
            cfg.model,
            device=env.device,
            seed=cfg.seed,
            tokenizer_texts=lambda: task_texts(splits, cfg.model.build.tokenizer_texts),
            sharded_later=True,  # the LM gives its config and weights to the RM; used after wrap
        )
        num_labels = cfg.loss.num_classes if cfg.kind == "prm" else 1
        self.sep_id = None
        if cfg.kind == "prm":
            from rlhflab.data.prm import separator_id

            self.sep_id = separator_id(tokenizer, d.step_separator)
        max_len = min(d.max_len, context_length(lm))
        train_items, eval_items, data_counts = build_rm_data(cfg, tokenizer, lm, splits, env.device)
        train_items, trunc = truncate_items(train_items, max_len)
        eval_items, _ = truncate_items(eval_items, max_len)
        data_counts["truncation"] = trunc
        if not train_items:
            raise DataError(f"data: no {cfg.kind} training examples ({data_counts})")
        self.train_items, self.eval_items, self.data_counts = train_items, eval_items, data_counts
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
        self.model = distributed.wrap(
            model, cfg.parallel, roots=[model.base_model, reward_head(model)]
        )
        self.tokenizer = tokenizer
        self.optimizer = make_optimizer(self.model, cfg.optim)
        self.scheduler = make_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        # Checkpoints hold model, optimizer, schedule, RNGs and the data position (the data
        # itself is rebuilt exactly by the set-up).
        self.stream = ShuffledStream(
            len(train_items), random.Random(cfg.seed), fingerprint=data_fingerprint(train_items),
            allow_change=cfg.run.allow_config_change,
        )  # fmt: skip
        self.last_loss = float("nan")
        self.final_eval: dict = {}
        self.bon: dict = {}

    def describe(self) -> str:
        return (
            f"{len(self.train_items)} train / {len(self.eval_items)} held-out "
            f"{self.cfg.kind} examples; data: {self.data_counts}"
        )

    def checkpointed(self) -> Checkpointed:
        return Checkpointed.one_model(self.model, self.optimizer, self.scheduler, self.stream)

    def state(self) -> dict:
        return {"last_loss": self.last_loss}

    def load_state(self, state: dict) -> None:
        self.last_loss = state["last_loss"]

    def step(self, step: int) -> tuple[dict, dict]:
        cfg, model, device = self.cfg, self.model, self.device
        batch = [self.train_items[i] for i in self.stream.take(cfg.train.batch_size)]  # global
        # counted once for the whole optimizer step, over the global batch (every rank)
        denom = loss_denominator(cfg, batch)
        local = distributed.shard(batch)  # this rank's contiguous share
        with self.timer.stage("update"):
            self.optimizer.zero_grad(set_to_none=True)
            step_loss = torch.zeros((), dtype=torch.float64)  # the step's loss, summed exactly
            acc_sum = acc_n = 0.0
            pairs = cfg.kind == "preference"  # chosen and rejected in one forward
            widths = [_widths(it, pairs) for it in local]
            for rows, pass_weight in micro_batches(
                cfg.train, list(range(len(local))), widths, seqs_per_row=2 if pairs else 1
            ):
                mb = [local[i] for i in rows]
                losses, weight, stats = rm_losses(
                    cfg, model, mb, self.tokenizer.pad_token_id, device, self.autocast_dtype
                )
                loss = losses.sum() / denom
                loss = faults.corrupt("loss", step, loss) * pass_weight
                loss.backward()
                if not pass_weight:  # a padding pass (common.micro_batches): no statistics
                    continue
                step_loss += loss.detach().cpu()
                acc_sum += float((stats["accuracy"] * weight).sum())
                acc_n += float(weight.sum())
            faults.hit("step_mid", step)
            step_loss = distributed.all_reduce_sum(step_loss)
            acc = distributed.sum_dict({"sum": acc_sum, "n": acc_n})
            acc_sum, acc_n = acc["sum"], acc["n"]
            grad_norm = grad_norm_and_clip(model, cfg.optim.max_grad_norm)
            if self.guard.check(step, {"train/loss": step_loss, "optim/grad_norm": grad_norm}):
                self.optimizer.step()
                self.scheduler.step()
        self.last_loss = float(step_loss)
        metrics = {
            "train/loss": self.last_loss,
            "rm/accuracy": acc_sum / max(acc_n, 1.0),
            "optim/grad_norm": float(grad_norm),
            "optim/lr": self.scheduler.get_last_lr()[0],
        }
        return metrics, {}

    def finish(self, step: int) -> None:
        # Held-out RM metrics (and best-of-N with the sampling policy).
        cfg, model, pad = self.cfg, self.model, self.tokenizer.pad_token_id
        model.eval()
        with distributed.gathered(model):  # every rank scores every held-out example
            self.final_eval = (
                evaluate_rm(cfg, model, self.eval_items, pad, self.device, self.autocast_dtype)
                if self.eval_items
                else {}
            )
        if self.final_eval:
            self.tracker.log(step, {f"eval/{k}": v for k, v in self.final_eval.items()})
        if cfg.eval.best_of_n and self.splits is not None and cfg.data.source == "task_samples":
            self.bon = self._best_of_n()

    def _best_of_n(self) -> dict:
        """Best-of-N on the held-out problems: samples of the sampling policy, picked by this
        reward model (`rlhflab.eval.best_of_n`)."""
        from rlhflab.eval.best_of_n import best_of_n_eval
        from rlhflab.rewards.reward_model import RewardModelScorer

        cfg, model = self.cfg, self.model
        scorer = RewardModelScorer(
            model,
            kind=cfg.kind,
            pad_token_id=self.tokenizer.pad_token_id,
            sep_id=self.sep_id,
            prm_reduce=cfg.loss.prm_reduce,
            autocast_dtype=self.autocast_dtype,
        )
        policy = _policy(cfg, self.device)
        with distributed.gathered(model):  # every rank runs it (the same draws)
            return best_of_n_eval(
                policy,
                self.tokenizer,
                self.splits.heldout[: cfg.eval.n_problems],
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

    def save(self, model_dir: Path) -> None:
        # the sequence-classification model (LoRA: adapters folded in), written by rank 0
        state = distributed.full_model_state(self.model, keep_tied=True)
        if distributed.is_main():
            merged = merged_state(self.model, state)  # LoRA: adapters folded in; else `state`
            save_reward_model(self.model, self.tokenizer, model_dir, state_dict=merged)

    def results(self) -> dict:
        return {
            "kind": self.cfg.kind,
            "final_loss": self.last_loss,
            "train_examples": len(self.train_items),
            "eval_examples": len(self.eval_items),
            "data": self.data_counts,
            "eval": self.final_eval,
            "best_of_n": self.bon.get("curves") if self.bon else None,
        }


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

_POLICIES: dict = {}


def _policy(cfg: RMConfig, device):
    """The sampling policy: data.policy, or the backbone checkpoint (model.name_or_path)."""
    from rlhflab.errors import ModelError
    from rlhflab.models.loading import load_model

    path = cfg.data.policy or cfg.model.name_or_path
    key = (path, str(device))
    if key not in _POLICIES:
        _POLICIES.clear()
        try:
            _POLICIES[key] = load_model(path, device=device).eval()
        except ModelError as exc:
            field = "data.policy" if cfg.data.policy else "model.name_or_path"
            raise ModelError(f"{field}: {exc}") from None
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
    if d.source == "step_labelled":
        from rlhflab.data.prm import load_step_labelled, tokenize_prm

        exs, outcomes, drops = load_step_labelled(d.path, tokenizer, split=d.split,
                                                  on_invalid=d.on_invalid, sep=d.step_separator,
                                                  system=cfg.task.system if cfg.task else None,
                                                  limit=d.max_rows)  # fmt: skip
        items = []
        for i, (ex, outcome) in enumerate(zip(exs, outcomes, strict=True)):
            p, comp, labels = tokenize_prm(
                tokenizer, ex, num_classes=cfg.loss.num_classes, sep=d.step_separator, row=i
            )
            if kind == "prm":
                items.append(StepLabelledCompletion(p, comp, labels))
            else:
                items.append(LabelledCompletion(p, comp, outcome))
        return (*_split_rows(items, d.heldout_frac), {"dropped": drops})
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


def _widths(item, pairs: bool) -> tuple[int, int]:
    """An item's (prompt, completion) tokens in the padded layout (a pair: the longer side)."""
    if pairs:
        return len(item.prompt_ids), max(len(item.chosen_ids), len(item.rejected_ids))
    return len(item.prompt_ids), len(item.completion_ids)


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

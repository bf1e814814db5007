"""Direct alignment: DPO and its relatives (cDPO, IPO, hinge, DPO-norm, SimPO, ORPO, APO, KTO).

Each step reads top to bottom:
    1. batch      `batch_size` pairs (KTO: labelled completions), micro-batches of `micro_batch_size`
    2. forward    chosen and rejected completions of a micro-batch in ONE forward
                  (KTO: the labelled completions and their mismatched (x_i, y_j) pairs), packed with
                  dynamic padding by `rollout.sampler.pack`, scored by `completion_logps` exactly as
                  SFT targets and sampled completions are; summed token log-probs and lengths
    3. loss       `loss.name` from rlhflab.losses.preference on (policy, cached reference) log-probs,
                  summed over the micro-batch and divided by the step's batch size
    4. log        dpo/* rewards, margin, accuracy, log-probs, loss-specific terms, grad norm, LR;
                  held-out preference accuracy every eval.pref_every steps; in-loop samples
Before training, a reference pass computes log π_ref of every sequence once (model in eval mode,
no gradients) and caches it with the dataset: no reference model is in memory while training.
Reference-free losses (SimPO, ORPO) skip it.

Data: a preference file (UltraFeedback, HH-RLHF, generic pairs, unpaired KTO rows), or verifiable
pairs — K samples per task prompt from the policy, best vs worst by the verifier (or the gold
answer). With `verifiable.rounds` > 1 this is iterative/online DPO: each round samples new pairs from
the current policy, which also becomes the reference for that round (Xu et al. 2023,
arXiv 2312.16682; Yuan et al. 2024, arXiv 2401.10020).

KTO: every labelled completion gets, once at data preparation, a fixed mismatched completion of
another prompt; z₀ is the mean reference-normalised log-ratio of the mismatched pairs of this
rank's micro-batch, so with KTO micro-batching changes z₀ slightly (TRL's KTOTrainer takes each
device's micro-batch mean too, but then averages it over the processes before the clamp, so
under data parallelism its z₀ is the mean over every rank's micro-batch); for every
other loss k micro-batches give exactly the gradient of one batch (tested).
Sampled completions are decoded and re-encoded with `encode_completion` (eos appended), exactly as
SFT targets are, so a sample cut at max_new_tokens is trained as if it had ended there.

Held-out preference accuracy: fraction of held-out pairs whose implicit reward margin is positive,
measured against the initial model (reference-based losses: (log π_θ − log π_ref)(y_w) >
(log π_θ − log π_ref)(y_l), summed log-probs; reference-free losses: average log-prob of y_w >
that of y_l); ties count one half, so a reference-based method starts at exactly 0.5.

The run's life (run directory, resume, checkpoints, stop signals, results) is the harness's
(rlhflab.trainers.loop); this module is the trainer's set-up, its optimizer step, its rounds and
its evaluations; the data side (rows, reference pass, pair sampling) is rlhflab.trainers.da_data.
"""

from __future__ import annotations

import random
import time

import torch

from rlhflab import distributed, faults
from rlhflab.config import DPOConfig
from rlhflab.data.formatting import task_instruction
from rlhflab.data.preference import (
    PreferencePair,
    UnpairedExample,
    load_preference_data,
    tokenize_pairs,
)
from rlhflab.data.prompts import load_prompt_source
from rlhflab.data.tasks import task_texts
from rlhflab.errors import DataError
from rlhflab.eval.accuracy import heldout_results, majority_baseline, majority_results
from rlhflab.experience.pairs import verifiable_pairs, write_greedy_samples
from rlhflab.fingerprint import data_fingerprint
from rlhflab.losses.preference import PREFERENCE_LOSSES, unpaired_loss_names
from rlhflab.models.loading import context_length
from rlhflab.models.lora import adapters_disabled, apply_lora
from rlhflab.ops import upcast
from rlhflab.rewards.shaping import TextRewardScorer
from rlhflab.rewards.verifier import Verifier
from rlhflab.trainers.common import (
    ShuffledStream,
    check_context_fit,
    grad_norm_and_clip,
    heldout_eval,
    make_optimizer,
    make_scheduler,
    micro_batches,
    prepare_model,
)
from rlhflab.trainers.da_data import (
    cache_reference,
    heldout_margins,
    paired_rows,
    sequence_logps,
    tokenize_unpaired,
    unpaired_rows,
    with_mismatched,
)
from rlhflab.trainers.loop import Checkpointed, Env, Trainer, run

__all__ = [
    "PREF_TIE_TOL",
    "DirectAlignment",
    "cache_reference",
    "paired_rows",
    "sequence_logps",
    "train",
    "verifiable_pairs",
]

#: Held-out margins closer to 0 than this are ties (float32 noise of summed log-probs is ~1e-5).
PREF_TIE_TOL = 1e-4

#: Paired-loss stats reported under dpo/* whatever the loss (the others under <loss.name>/*).
SHARED_STATS = ("chosen_reward", "rejected_reward", "margin", "accuracy")


def train(cfg: DPOConfig) -> dict:
    """Run direct alignment as configured; returns final results (also in final_results.json)."""
    return run(cfg, DirectAlignment)


class DirectAlignment(Trainer):
    """Direct alignment under the run harness (rlhflab.trainers.loop): set-up with the reference
    pass, one optimizer step over pairs (KTO: labelled completions), online rounds, held-out
    preference accuracy and task accuracy."""

    name = "direct_alignment"
    headline = ("train/loss", "dpo/accuracy", "eval/pref_accuracy", "eval/accuracy")
    writes_samples = True

    def __init__(self, cfg: DPOConfig, env: Env) -> None:
        """Set-up: prompts, model, training and held-out rows, optimizer, the reference pass and
        the data stream. Validation only: nothing is written.

        Raises:
            DataError: a preference file of unpaired rows under a paired loss, too few pairs
                for `data.heldout_pairs`, no training pairs, rows longer than the context.
        """
        super().__init__(cfg, env)
        # what the loss needs, as its registry entry declares it
        loss = PREFERENCE_LOSSES[cfg.loss.name]
        self.loss_fn, self.unpaired, self.wants_lengths = loss.fn, loss.unpaired, loss.lengths
        self.use_ref = not loss.reference_free  # reference-free: no reference pass
        self.verifiable = cfg.data.source == "verifiable"
        model = self._prompts_and_model()
        self.chunk = 2 * cfg.train.micro_batch_size
        self.rng = random.Random(cfg.seed)
        self.generator = torch.Generator(device=env.device).manual_seed(cfg.seed)
        self.tok_kw = {
            "max_prompt_len": cfg.data.max_prompt_len,
            "max_completion_len": cfg.data.max_completion_len,
            "truncation_side": cfg.data.truncation_side,
        }
        heldout_pairs, train_pairs = self._pairs(model)
        self.rows, self.trunc = self._build_rows(train_pairs)
        held_tok, _ = tokenize_pairs(self.tokenizer, heldout_pairs, **self.tok_kw)
        self.held_rows = paired_rows(held_tok)
        check_context_fit(self.rows, context_length(model), what="data (training rows)")
        check_context_fit(self.held_rows, context_length(model), what="data (held-out pairs)")
        distributed.check_split(cfg.train.batch_size, "train.batch_size", "rows")
        model = apply_lora(model, cfg.model.lora)  # model.lora unset: unchanged
        self.model = distributed.wrap(model, cfg.parallel)  # one process: unchanged
        self.optimizer = make_optimizer(self.model, cfg.optim)
        self.scheduler = make_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.reference_pass_s = self._reference_pass()
        # Training steps in rounds (rounds > 1: new on-policy pairs and reference each round).
        # Checkpoints hold model, optimizer, schedule, RNGs, the data position and, from round 2
        # on, the round's rows with their cached reference log-probs (round 1's are rebuilt
        # exactly by this set-up).
        self.steps_per_round = cfg.train.steps // cfg.verifiable.rounds
        self.later_round = False  # self.rows are a later round's (checkpointed), not round 1's
        self.stream = ShuffledStream(  # shares rng with the rounds' prompt draws
            len(self.rows), self.rng,
            fingerprint=data_fingerprint([{k: v for k, v in r.items() if not k.startswith("ref")}
                                          for r in self.rows]),
            allow_change=cfg.run.allow_config_change,
        )  # fmt: skip
        self.last_loss = float("nan")
        self.initial_eval: dict = {}
        self.initial_pref: dict = {}
        self.final_eval: dict = {}
        self.final_pref: dict = {}

    # -- Set-up ------------------------------------------------------------------------------
    def _prompts_and_model(self):
        """Prompt source (task or dataset), tokenizer, model (before LoRA / wrapping), verifier,
        held-out task problems and their majority baseline; returns the model."""
        cfg, t = self.cfg, self.cfg.task
        # Task accuracy only where a task is the run's own: verifiable pairs, or a `task` section
        # set explicitly beside a preference file (never the default task's).
        task_eval = cfg.eval.n > 0 and (self.verifiable or "task" in cfg.model_fields_set)
        splits = None
        if self.verifiable or task_eval or cfg.model.build is not None:
            splits = load_prompt_source(cfg.prompts, t, seed=cfg.seed)
        self.splits = splits
        self.system = t.system if cfg.prompts.source == "task" else cfg.prompts.system
        # The answer-format instruction after each task question (task.instruction); none for
        # datasets.
        self.instruction = task_instruction(t) if cfg.prompts.source == "task" else None
        self.tokenizer, model = prepare_model(
            cfg.model,
            device=self.device,
            seed=cfg.seed,
            tokenizer_texts=lambda: task_texts(splits, cfg.model.build.tokenizer_texts),
            sharded_later=not self.verifiable,  # verifiable pairs sample before wrap
        )
        self.pad = self.tokenizer.pad_token_id
        self.verifier = Verifier(
            answer_format=t.answer_format, reward=t.reward, extractor=t.extractor
        )
        # Held-out score: the task's verifier, or a prompt dataset's text-computable rewards.
        self.scorer = self.verifier
        if cfg.prompts.source == "dataset" and self.verifiable:
            self.scorer = TextRewardScorer(cfg.verifiable.reward, self.verifier)
        self.heldout_tasks = (
            splits.heldout[: cfg.eval.n] if splits is not None and task_eval else []
        )
        # Beside every task accuracy: the most common training answer given to every held-out
        # problem.
        self.baseline = (
            majority_baseline(splits.train, self.heldout_tasks, self.verifier)
            if self.heldout_tasks and self.scorer is self.verifier
            else None
        )
        return model

    def _pairs(self, model) -> tuple[list, list]:
        """(held-out pairs, training pairs or unpaired examples): sampled from `model` and
        labelled (verifiable), or read from the preference file and split."""
        cfg = self.cfg
        self.drops: dict[str, int] = {}
        self.data_counts: dict = {}
        self.file_unpaired = False  # a preference file of unpaired (KTO) rows
        if self.verifiable:
            heldout = self.splits.heldout[: cfg.data.heldout_pairs]
            heldout_pairs, self.data_counts["heldout"] = self._sample_pairs(model, heldout)
            train_pairs, self.data_counts["round_1"] = self._round_pairs(model)
        else:
            examples, self.drops = load_preference_data(
                cfg.data.path,
                cfg.data.format,
                split=cfg.data.split,
                on_invalid=cfg.data.on_invalid,
                max_rows=cfg.data.max_rows,
            )
            self.rng.shuffle(examples)
            # format "unpaired" or detected
            self.file_unpaired = isinstance(examples[0], UnpairedExample)
            if self.file_unpaired and not self.unpaired:
                raise DataError(f"data.path: {cfg.data.path} holds unpaired rows (prompt, "
                                f"completion, label): they need loss.name "
                                f"{unpaired_loss_names()}, not '{cfg.loss.name}'")  # fmt: skip
            n_held = cfg.data.heldout_pairs
            if not self.file_unpaired and n_held >= len(examples):
                raise DataError(f"data.heldout_pairs ({n_held}) must be smaller than the "
                                f"{len(examples)} pairs of {cfg.data.path}")  # fmt: skip
            heldout_pairs = [] if self.file_unpaired else examples[:n_held]
            train_pairs = examples if self.file_unpaired else examples[n_held:]
        if not train_pairs:
            raise DataError(
                f"data: no training pairs ({self.data_counts.get('round_1', {})}); with "
                "verifiable pairs the policy needs some correct and some wrong samples, or "
                "verifiable.chosen 'gold'"
            )
        return heldout_pairs, train_pairs

    def _sample_pairs(self, model, problems) -> tuple[list[PreferencePair], dict]:
        """Pairs sampled from `model` on `problems` and labelled (`verifiable_pairs`)."""
        cfg = self.cfg
        return verifiable_pairs(
            model, self.tokenizer, problems, self.verifier, cfg.verifiable, cfg.task,
            generator=self.generator, rng=self.rng, chunk=cfg.eval.batch_size,
            autocast_dtype=self.autocast_dtype, system=self.system, instruction=self.instruction,
        )  # fmt: skip

    def _round_pairs(self, model) -> tuple[list[PreferencePair], dict]:
        """A round's training pairs: `verifiable.n_prompts` training prompts drawn from `rng`."""
        train = self.splits.train
        problems = self.rng.sample(train, min(self.cfg.verifiable.n_prompts, len(train)))
        return self._sample_pairs(model, problems)

    def _build_rows(self, pairs) -> tuple[list[dict], dict]:
        """Training rows of `pairs` (paired, or unpaired KTO rows) and their truncation counts."""
        if self.file_unpaired:
            rows, counts = tokenize_unpaired(self.tokenizer, pairs, self.tok_kw)
            return with_mismatched(rows, self.rng), counts
        tokenized, counts = tokenize_pairs(self.tokenizer, pairs, **self.tok_kw)
        rows = unpaired_rows(tokenized, self.rng) if self.unpaired else paired_rows(tokenized)
        return rows, counts

    def _reference_pass(self) -> float:
        """Cache log π_ref of the training rows (reference-based losses) and of the held-out
        pairs: no reference model is kept. π_ref is the initial model: with LoRA, the base with
        its adapters disabled. Returns its duration in seconds."""
        t_ref = time.perf_counter()
        kw = {"chunk": self.chunk, "autocast_dtype": self.autocast_dtype}
        with adapters_disabled(self.model):
            if self.use_ref:
                cache_reference(self.model, self.rows, self.pad, unpaired=self.unpaired, **kw)
            if self.held_rows:  # held-out pairs are always scored against the initial model
                cache_reference(self.model, self.held_rows, self.pad, unpaired=False, **kw)
        return time.perf_counter() - t_ref

    # -- What the harness asks ---------------------------------------------------------------
    def describe(self) -> str:
        dropped = sum(self.drops.values()) if self.drops else 0
        return (
            f"{len(self.rows)} training rows, {len(self.held_rows)} held-out pairs, "
            f"dropped: {dropped}, truncated: {self.trunc}, "
            f"reference pass {self.reference_pass_s:.1f}s"
        )

    def checkpointed(self) -> Checkpointed:
        return Checkpointed.one_model(
            self.model, self.optimizer, self.scheduler, self.stream, {"sampler": self.generator}
        )

    def begin(self) -> None:
        self.initial_eval = self.evaluate(0) if self.heldout_tasks else {}
        self.initial_pref = self.pref_eval(0)

    def state(self) -> dict:
        return {
            "rows": self.rows if self.later_round else None,
            "data_counts": self.data_counts,
            "last_loss": self.last_loss,
            "initial_eval": self.initial_eval,
            "initial_pref": self.initial_pref,
        }

    def load_state(self, state: dict) -> None:
        self.last_loss, self.data_counts = state["last_loss"], state["data_counts"]
        self.initial_eval, self.initial_pref = state["initial_eval"], state["initial_pref"]
        if state["rows"] is not None:
            self.rows, self.later_round = state["rows"], True

    def step(self, step: int) -> tuple[dict, dict]:
        cfg, B = self.cfg, self.cfg.train.batch_size
        if self.verifiable and step > 1 and (step - 1) % self.steps_per_round == 0:
            with self.timer.stage("rollout"):  # a new round: sampling and its reference pass
                self._next_round(step)
        t0 = time.perf_counter()
        batch_idx = self.stream.take(B)  # the global batch; this rank trains on its share
        local_idx = distributed.shard(batch_idx)
        with self.timer.stage("update"):
            self.optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            n_tokens = 0
            for mb_idx, weight in micro_batches(
                cfg.train, local_idx, [self._widths(i) for i in local_idx], seqs_per_row=2
            ):
                mb = [self.rows[i] for i in mb_idx]
                losses, stats, tokens = (
                    self._unpaired_loss if self.unpaired else self._paired_loss
                )(mb)
                # the global step's mean over pairs (B counts every rank's pairs), whatever the
                # micro-batching and the number of ranks
                loss = losses.sum() / B
                loss = faults.corrupt("loss", step, loss) * weight
                loss.backward()
                if not weight:  # a padding pass (common.micro_batches): no statistics
                    continue
                n_tokens += tokens
                sums["train/loss"] = sums.get("train/loss", 0.0) + loss.item()
                for k, val in stats.items():
                    sums[k] = sums.get(k, 0.0) + upcast(val).sum().item() / B
            faults.hit("step_mid", step)
            sums = distributed.sum_dict({**sums, "n_tokens": n_tokens})  # global sums
            n_tokens = sums.pop("n_tokens")
            grad_norm = grad_norm_and_clip(self.model, cfg.optim.max_grad_norm)
            if self.guard.check(
                step, {"train/loss": sums["train/loss"], "optim/grad_norm": grad_norm}
            ):
                self.optimizer.step()
                self.scheduler.step()
        self.timer.count(trained=n_tokens)
        self.last_loss = sums["train/loss"]
        if self.unpaired:  # means over desirable / undesirable examples
            nd = sums.pop("kto/desirable_n") * B
            sums["kto/chosen_reward"] = sums.pop("kto/reward_desirable_sum") * B / max(nd, 1)
            sums["kto/rejected_reward"] = (
                sums.pop("kto/reward_undesirable_sum") * B / max(B - nd, 1)
            )
        dt = time.perf_counter() - t0
        metrics = {
            **sums,
            "optim/grad_norm": float(grad_norm),
            "optim/lr": self.scheduler.get_last_lr()[0],
            "perf/tokens_per_s": n_tokens / dt,
        }
        return metrics, {}

    def _next_round(self, step: int) -> None:
        """Online DPO, at the first step of round r > 1: new pairs sampled from the policy as it
        is now, which is also this round's reference (its log-probs cached); a new data pass."""
        r = (step - 1) // self.steps_per_round + 1
        new_pairs, self.data_counts[f"round_{r}"] = self._round_pairs(self.model)
        if new_pairs:
            self.rows, _ = self._build_rows(new_pairs)
            if self.use_ref:  # the reference of this round is the policy as it is now
                cache_reference(
                    self.model, self.rows, self.pad, unpaired=self.unpaired, chunk=self.chunk,
                    autocast_dtype=self.autocast_dtype,
                )  # fmt: skip
            self.stream.restart(len(self.rows))
        self.later_round = True
        self.tracker.print(f"round {r}: {self.data_counts[f'round_{r}']}")

    def _widths(self, i: int) -> tuple[int, int]:
        """Row i's (prompt, longer completion) tokens: its two sequences' padded widths."""
        r = self.rows[i]
        if self.unpaired:
            return len(r["prompt"]), max(len(r["completion"]), len(r["kl_completion"]))
        return len(r["prompt"]), max(len(r["chosen"]), len(r["rejected"]))

    def _paired_loss(self, mb: list[dict]) -> tuple[torch.Tensor, dict, int]:
        """Losses (n,) of a micro-batch of n pairs, their stats (dpo/*, <loss>/*, logps/*; each
        (n,) to be summed) and its completion tokens: chosen and rejected in one forward,
        against the cached reference (reference-based losses)."""
        n, device = len(mb), self.device
        prompts = [r["prompt"] for r in mb] * 2
        completions = [r["chosen"] for r in mb] + [r["rejected"] for r in mb]
        logps, lengths = sequence_logps(self.model, prompts, completions, self.pad,
                                        autocast_dtype=self.autocast_dtype)  # fmt: skip
        self._count_flops(prompts, completions)
        pc, pr = logps[:n], logps[n:]
        rc = rr = None
        if self.use_ref:
            rc = torch.tensor([r["ref_chosen"] for r in mb], dtype=pc.dtype, device=device)
            rr = torch.tensor([r["ref_rejected"] for r in mb], dtype=pc.dtype, device=device)
        kw = {"chosen_lengths": lengths[:n], "rejected_lengths": lengths[n:]}
        kw = kw if self.wants_lengths else {}
        losses, stats = self.loss_fn(pc, pr, rc, rr, **kw, **self.cfg.loss.args)
        name = self.cfg.loss.name
        stats = {(f"dpo/{k}" if k in SHARED_STATS else f"{name}/{k}"): v for k, v in stats.items()}
        stats["logps/chosen"] = pc.detach()
        stats["logps/rejected"] = pr.detach()
        return losses, stats, int(lengths.sum())

    def _count_flops(self, prompts: list[list[int]], completions: list[list[int]]) -> None:
        """The update's model FLOPs of one forward + backward over these rows (prompt +
        completion tokens, at the micro-batch's padded width) for `self.timer`."""
        lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
        self.timer.train("update", sum(lengths), max(lengths))

    def _unpaired_loss(self, mb: list[dict]) -> tuple[torch.Tensor, dict, int]:
        """KTO: losses (n,) of a micro-batch of n labelled completions, their stats (kto/*,
        logps/completion; sums, turned into means over desirable / undesirable examples by
        `step`) and its tokens: the completions and their mismatched (x_i, y_j) in one forward."""
        n, device = len(mb), self.device
        prompts = [r["prompt"] for r in mb] * 2
        completions = [r["completion"] for r in mb] + [r["kl_completion"] for r in mb]
        logps, lengths = sequence_logps(self.model, prompts, completions, self.pad,
                                        autocast_dtype=self.autocast_dtype)  # fmt: skip
        self._count_flops(prompts, completions)
        pc, pr = logps[:n], logps[n:]
        ref = torch.tensor([r["ref"] for r in mb], dtype=pc.dtype, device=device)
        ref_kl = torch.tensor([r["ref_kl"] for r in mb], dtype=pc.dtype, device=device)
        label = torch.tensor([r["label"] for r in mb], device=device)
        losses, stats = self.loss_fn(pc, ref, label, pr, ref_kl, **self.cfg.loss.args)
        d = stats["desirable"]
        stats = {
            "kto/kl": stats["kl"].expand(n),
            "kto/kl_raw": stats["kl_raw"].expand(n),
            "kto/reward_desirable_sum": stats["reward"] * d,
            "kto/reward_undesirable_sum": stats["reward"] * (1 - d),
            "kto/desirable_n": d,
            "logps/completion": pc.detach(),
        }
        return losses, stats, int(lengths.sum())

    # -- Evaluations -------------------------------------------------------------------------
    def has_heldout(self) -> bool:
        return bool(self.heldout_tasks)

    def evaluate(self, step: int) -> dict:
        res = heldout_eval(
            self.cfg, self.model, self.tokenizer, self.heldout_tasks, self.scorer, self.tracker,
            step, self.autocast_dtype, system=self.system, instruction=self.instruction,
            baseline=self.baseline,
        )  # fmt: skip
        self.health.observe_eval(step, res)  # held-out accuracy against dpo/margin: reward_hacking
        return res

    @torch.no_grad()
    def pref_eval(self, step: int) -> dict:
        """Held-out preference accuracy and mean margin at `step` (logged; {} without held-out
        pairs). Ties (|margin| ≤ PREF_TIE_TOL, e.g. every pair while π_θ = π_ref) count one half."""
        if not self.held_rows:
            return {}
        model = self.model
        was_training = model.training
        model.eval()
        with distributed.gathered(model):  # every rank scores every held-out pair
            margins = heldout_margins(
                model, self.held_rows, self.cfg, self.pad, self.use_ref, self.autocast_dtype
            )
        model.train(was_training)
        m = torch.cat(margins)
        acc = ((m > PREF_TIE_TOL).float() + 0.5 * (m.abs() <= PREF_TIE_TOL).float()).mean()
        res = {
            "eval/pref_accuracy": acc.item(),
            "eval/pref_margin": m.mean().item(),
        }
        self.tracker.log(step, res)
        return res

    def periodic(self, step: int, metrics: dict) -> dict:
        # the held-out preference accuracy every eval.pref_every steps, then the task accuracy
        # every eval.every steps (the harness's default)
        out = {}
        if self.cfg.eval.pref_every and step % self.cfg.eval.pref_every == 0:
            out.update(self.pref_eval(step))
        out.update(super().periodic(step, metrics))
        return out

    def write_samples(self, step: int) -> None:
        # greedy completions of the first held-out prompts, at step 1 and every samples_every
        tr = self.cfg.tracking
        if (step % tr.samples_every == 0 or step == 1) and tr.samples_per_step:
            write_greedy_samples(
                self.samples, step, self.model, self.tokenizer, self.heldout_tasks, self.scorer,
                self.cfg, self.autocast_dtype, self.system, self.instruction,
            )  # fmt: skip

    def finish(self, step: int) -> None:
        self.final_pref = self.pref_eval(step)
        self.final_eval = self.evaluate(step) if self.heldout_tasks else {}

    def results(self) -> dict:
        cfg, splits, final_eval = self.cfg, self.splits, self.final_eval
        return {
            "loss": cfg.loss.name,
            "final_loss": self.last_loss,
            "train_rows": len(self.rows),
            "dropped": self.drops,
            "truncated": self.trunc,
            "pairs": self.data_counts,
            "heldout_pref_accuracy_before": self.initial_pref.get("eval/pref_accuracy"),
            "heldout_pref_accuracy": self.final_pref.get("eval/pref_accuracy"),
            "heldout_pref_n": len(self.held_rows),
            **heldout_results(self.initial_eval, final_eval),
            **majority_results(self.baseline),
            "heldout_overlap_dropped": splits.n_heldout_overlap_dropped if splits else None,
            "reference_pass_s": round(self.reference_pass_s, 2),
        }

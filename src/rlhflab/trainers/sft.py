"""Supervised fine-tuning: prompt-masked cross-entropy on (prompt, completion) pairs.

    loss = − Σ_{i,t} mask_{i,t} · log π_θ(y_{i,t} | x_i, y_{i,<t}) / N_tokens

N_tokens counts the trained tokens of the whole optimizer step (all micro-batches), so k
micro-batches give exactly the gradient of one batch. Prompt tokens carry no loss. Pairs come
from a reasoning_gym task (question → answer in the configured answer format) or a dataset
(`text`, `messages` or `prompt`/`completion` rows; rlhflab.data.sft). A multi-turn `messages`
row trains every assistant turn (data.assistant_turns "all"): mask is 0 on the user turns between
them; a `text` row trains every token.

The run's life (run directory, resume, checkpoints, stop signals, results) is the harness's
(rlhflab.trainers.loop); this module is SFT's set-up, its optimizer step and its evaluations.
"""

from __future__ import annotations

import random
import time

import torch

from rlhflab import distributed, faults
from rlhflab.config import SFTConfig
from rlhflab.data.formatting import task_instruction
from rlhflab.data.sft import load_sft_data, sft_examples_from_problems, split_features, tokenize_sft
from rlhflab.data.tasks import make_splits, task_texts
from rlhflab.eval.accuracy import heldout_results, majority_baseline, majority_results
from rlhflab.fingerprint import data_fingerprint
from rlhflab.losses.aggregate import aggregate
from rlhflab.models.loading import context_length
from rlhflab.models.lora import apply_lora
from rlhflab.rewards.verifier import Verifier
from rlhflab.rollout.sampler import completion_logps, pack
from rlhflab.trainers.common import (
    ShuffledStream,
    grad_norm_and_clip,
    heldout_eval,
    make_optimizer,
    make_scheduler,
    micro_batches,
    prepare_model,
)
from rlhflab.trainers.loop import Checkpointed, Env, Trainer, run


def train(cfg: SFTConfig) -> dict:
    """Run SFT as configured; returns the final results dict (also in final_results.json)."""
    return run(cfg, SFT)


class SFT(Trainer):
    """Supervised fine-tuning under the run harness (rlhflab.trainers.loop)."""

    name = "sft"
    headline = ("train/loss", "eval/accuracy")

    def __init__(self, cfg: SFTConfig, env: Env) -> None:
        """Set-up: task or dataset, model, tokenized pairs, optimizer (validation only)."""
        super().__init__(cfg, env)
        cfg.data.check_made()  # a preset's data file that a command makes: say which
        needs_task = cfg.data.source == "task" or cfg.model.build is not None or cfg.eval.n > 0
        splits = None
        if needs_task:
            t = cfg.task
            splits = make_splits(
                t.name, config=t.config, n_train=t.n_train, n_heldout=t.n_heldout, seed=t.seed
            )
        self.splits = splits
        tokenizer, model = prepare_model(
            cfg.model,
            device=env.device,
            seed=cfg.seed,
            tokenizer_texts=lambda: task_texts(splits, cfg.model.build.tokenizer_texts),
            sharded_later=True,  # weights used after wrap only
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
        self.pairs = [split_features(f) for f in features]
        self.drops = drops
        self.verifier = Verifier(
            answer_format=cfg.task.answer_format,
            reward=cfg.task.reward,
            extractor=cfg.task.extractor,
        )
        self.heldout = splits.heldout[: cfg.eval.n] if splits is not None and cfg.eval.n > 0 else []
        # Beside the accuracy: the most common training answer given to every held-out problem.
        self.baseline = (
            majority_baseline(splits.train, self.heldout, self.verifier) if self.heldout else None
        )
        distributed.check_split(cfg.train.batch_size, "train.batch_size", "rows")
        model = apply_lora(model, cfg.model.lora)  # model.lora unset: unchanged
        self.model = distributed.wrap(model, cfg.parallel)  # one process: unchanged
        self.tokenizer = tokenizer
        self.optimizer = make_optimizer(self.model, cfg.optim)
        self.scheduler = make_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        # Shuffled epochs over the pairs, batch_size pairs per optimizer step, drawn in one
        # global order; each data-parallel rank trains on its contiguous share.
        self.stream = ShuffledStream(
            len(self.pairs), random.Random(cfg.seed),
            # single-turn rows keep the (prompt, completion) fingerprint of earlier versions
            fingerprint=data_fingerprint([p[:2] if all(p[2]) else p for p in self.pairs]),
            allow_change=cfg.run.allow_config_change,
        )  # fmt: skip
        self.last_loss = float("nan")
        self.initial_eval: dict = {}
        self.final_eval: dict = {}

    def describe(self) -> str:
        return f"{len(self.pairs)} examples, dropped: {self.drops or 0}"

    def checkpointed(self) -> Checkpointed:
        # model, optimizer, schedule and the data position (`order`); the harness adds the rest
        return Checkpointed.one_model(self.model, self.optimizer, self.scheduler, self.stream)

    def has_heldout(self) -> bool:
        return bool(self.heldout)

    def evaluate(self, step: int) -> dict:
        return heldout_eval(
            self.cfg, self.model, self.tokenizer, self.heldout, self.verifier, self.tracker,
            step, self.autocast_dtype, baseline=self.baseline,
        )  # fmt: skip

    def begin(self) -> None:
        # Step 0, like the RL trainers: the held-out accuracy before training. Greedy decoding
        # draws from no generator, so the training stream (data order, RNGs) is unchanged.
        self.initial_eval = self.evaluate(0) if self.heldout else {}

    def state(self) -> dict:
        return {"last_loss": self.last_loss, "initial_eval": self.initial_eval}

    def load_state(self, state: dict) -> None:
        self.last_loss = state["last_loss"]
        self.initial_eval = state.get("initial_eval", {})  # checkpoints before it: unknown

    def step(self, step: int) -> tuple[dict, dict]:
        cfg, pairs, model = self.cfg, self.pairs, self.model
        t0 = time.perf_counter()
        batch_idx = self.stream.take(cfg.train.batch_size)  # the global batch
        # Denominator: trained tokens of the whole global step (all ranks, all micro-batches),
        # counted once before the micro-batches.
        num_tokens = sum(sum(pairs[i][2]) for i in batch_idx)
        local_idx = distributed.shard(batch_idx)
        self.timer.count(trained=num_tokens)
        with self.timer.stage("update"):
            self.optimizer.zero_grad(set_to_none=True)
            step_loss = torch.zeros((), dtype=torch.float64)  # the step's loss, summed exactly
            widths = [(len(pairs[i][0]), len(pairs[i][1])) for i in local_idx]
            for idx, weight in micro_batches(cfg.train, local_idx, widths):
                mb = pack(
                    [pairs[i][0] for i in idx],
                    [pairs[i][1] for i in idx],
                    self.tokenizer.pad_token_id,
                )
                mb = mb.to(self.device)
                loss_mask = mb.mask.clone()  # (B, T): 1 on trained completion tokens
                for r, i in enumerate(idx):
                    loss_mask[r, : len(pairs[i][2])] = torch.tensor(pairs[i][2])
                logp, _ = completion_logps(model, mb, autocast_dtype=self.autocast_dtype)
                tokens, width = float(mb.attention_mask.sum()), mb.attention_mask.size(1)
                self.timer.train("update", tokens * weight, width)
                loss = aggregate(-logp, loss_mask, "token_mean", num_tokens=num_tokens)
                loss = faults.corrupt("loss", step, loss) * weight
                loss.backward()
                step_loss += loss.detach().cpu()
            faults.hit("step_mid", step)
            step_loss = distributed.all_reduce_sum(step_loss)  # the global batch's loss
            grad_norm = grad_norm_and_clip(model, cfg.optim.max_grad_norm)
            if self.guard.check(step, {"train/loss": step_loss, "optim/grad_norm": grad_norm}):
                self.optimizer.step()
                self.scheduler.step()
        self.last_loss = float(step_loss)
        dt = time.perf_counter() - t0
        metrics = {
            "train/loss": self.last_loss,
            "optim/grad_norm": float(grad_norm),
            "optim/lr": self.scheduler.get_last_lr()[0],
            "perf/tokens_per_s": num_tokens / dt,
        }
        return metrics, {"sample": mb}

    def finish(self, step: int) -> None:
        self.final_eval = self.evaluate(step) if self.heldout else {}

    def results(self) -> dict:
        final_eval, splits = self.final_eval, self.splits
        return {
            "final_loss": self.last_loss,
            "examples": len(self.pairs),
            "dropped": self.drops,
            **heldout_results(self.initial_eval, final_eval),
            **majority_results(self.baseline),
            "heldout_overlap_dropped": splits.n_heldout_overlap_dropped if splits else None,
        }

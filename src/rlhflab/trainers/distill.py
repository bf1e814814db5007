"""Distillation: on-policy distillation, GKD and the book's SDPO, composed from named parts.

Each step reads top to bottom (`Distill.step`):
    1. batch      prompts_per_step prompts × group_size completions, sampled from the student
                  (on-policy) through the experience layer's `Sampler` in the configured mode
                  (sync, async, dynamic sampling, episodes with an `env`; rlhflab.experience),
                  or, with probability 1 − loss.lmbda (GKD's λ), from the teacher
                  (sequence-level KD on teacher outputs). With teacher.source "self" (SDPO),
                  prompts whose group has no correct completion are skipped and further prompts
                  drawn until the batch is full (at most sdpo.max_rounds draws, then a DataError)
    2. teacher    the teacher's view of each completion: the same prompt (a teacher model), or
                  the question with a correct sibling completion as a demonstration (SDPO: the
                  student itself, no gradient; a row whose only correct sibling is itself has no
                  demonstration and is left out of the loss, as in the book's earlier
                  LiveCodeBench rollout.py; its current version gives every row the group's first
                  correct completion, its own included)
    3. update     one optimizer step on `loss.divergence` (rlhflab.losses.distill.DIVERGENCES),
                  the mean over the batch's completion tokens, accumulated over micro-batches:
                  full-distribution divergences from both models' hidden states in row-chunks
                  (no (B, T, V) logits), the sampled-token estimator from the sampled tokens'
                  log-probs only
    4. log        distill/kl (per-token KL(student ‖ teacher)), its quantiles, argmax agreement,
                  the batch's verifier accuracy; held-out greedy accuracy every eval.every steps
The run's life (run directory, resume, checkpoints, stop signals, results) is the harness's
(rlhflab.trainers.loop). The teacher is frozen and not checkpointed: it is reloaded from
teacher.name_or_path (a config key, so a resume with another teacher is refused).

Teachers are checked at start (`load_teacher`): a causal LM (its saved `architectures` a
`...ForCausalLM` / `...LMHeadModel`; a reward model, `...ForSequenceClassification`, would load
with a random LM head) with the student's tokenizer and vocabulary size, and not the student's
own weights (`same_weights`): then the on-policy KL is 0, its gradient float noise (norm ~4e-8),
which AdamW, dividing by sqrt(v), turns into updates of full size, so the run trains on noise.
That is refused unless `teacher.allow_same_as_student: true` (a control run), which warns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
from pathlib import Path

import torch

from rlhflab import distributed, faults
from rlhflab.config.distill import DistillConfig
from rlhflab.data.formatting import encode_prompt
from rlhflab.errors import ConfigError, DataError
from rlhflab.eval.accuracy import majority_baseline, majority_results
from rlhflab.experience import PromptSet, Sampler, VerifierOnly
from rlhflab.losses.distill import DIVERGENCES, chunked_divergence
from rlhflab.models.loading import context_length
from rlhflab.models.lora import apply_lora
from rlhflab.rewards.verifier import Verifier
from rlhflab.rollout.dynamic import ScoredBatch
from rlhflab.rollout.sampler import Rollout, completion_head, completion_logps, left_pad
from rlhflab.trainers.common import (
    grad_norm_and_clip,
    heldout_eval,
    make_optimizer,
    make_scheduler,
    micro_batches,
    prepare_model,
)
from rlhflab.trainers.loop import Checkpointed, Env, Trainer, run

KL_QUANTILES = (0.5, 0.9, 0.99)  # distill/kl_p50, _p90, _p99 (and distill/kl_max)


def train(cfg: DistillConfig) -> dict:
    """Run distillation as configured; returns final results (also in final_results.json)."""
    return run(cfg, Distill)


def teacher_path(name_or_path: str) -> str:
    """A run directory's `model/` (a directory with final_results.json or config.yaml and a
    model/ subdirectory), else `name_or_path` itself (a model directory or hub id)."""
    p = Path(name_or_path).expanduser()
    if (p / "model").is_dir() and (
        (p / "final_results.json").exists() or (p / "config.yaml").exists()
    ):
        return str(p / "model")
    return name_or_path


def check_same_tokenizer(student_tok, teacher_tok, student: str, teacher: str) -> None:
    """Raise ConfigError (one line, naming both) unless the two tokenizers have the same
    vocabulary (token → id) and special tokens; cross-tokenizer distillation is not supported."""
    a, b = student_tok.get_vocab(), teacher_tok.get_vocab()
    specials = ("eos_token_id", "pad_token_id", "bos_token_id")
    same_specials = all(getattr(student_tok, s) == getattr(teacher_tok, s) for s in specials)
    if a != b or not same_specials:
        diff = len(set(a.items()) ^ set(b.items()))
        raise ConfigError(
            f"teacher.name_or_path: the teacher's tokenizer ({teacher}, {len(b)} tokens) differs "
            f"from the student's ({student}, {len(a)} tokens; {diff} token/id pairs differ"
            f"{'' if same_specials else ', special tokens differ'}); cross-tokenizer distillation "
            "is not supported"
        )


#: Endings of the class names of causal LMs in a config's `architectures` (transformers'
#: `...ForCausalLM`, GPT-2's `GPT2LMHeadModel`; rlhflab's own `GPTForCausalLM`).
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def check_causal_lm(teacher, name: str) -> None:
    """Raise ConfigError (one line naming `teacher.name_or_path`) when the loaded teacher's
    saved `architectures` name no causal LM (`CAUSAL_LM_SUFFIXES`), e.g. a reward model
    (`Qwen3ForSequenceClassification`): `AutoModelForCausalLM` loads such a checkpoint's body and
    leaves its LM head random, so it would teach noise. A config without `architectures` passes
    (nothing says what it is)."""
    archs = list(getattr(teacher.config, "architectures", None) or [])
    if archs and not any(a.endswith(CAUSAL_LM_SUFFIXES) for a in archs):
        raise ConfigError(
            f"teacher.name_or_path: {name} is a {', '.join(archs)}, not a causal LM "
            "(...ForCausalLM): a teacher must be a language model with the student's "
            "vocabulary, not a reward model or classifier"
        )


def _comparable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under the names of a plain model: a LoRA model's base weights
    (`base_layer` / `original_module` names folded, adapters left out, as they start at zero)."""
    from rlhflab.models.lora import is_lora

    if not is_lora(model):
        return model.state_dict()
    out = {}
    for k, v in model.state_dict().items():  # adapters are injected in place (no PeftModel)
        if "lora_" in k or ".modules_to_save." in k:
            continue
        out[k.replace(".base_layer.", ".").replace(".original_module.", ".")] = v
    return out


def same_weights(student: torch.nn.Module, teacher: torch.nn.Module) -> bool:
    """Whether the teacher holds the student's weights: the same names and shapes, and every
    tensor equal once the student's is cast to the teacher's dtype (a bf16 teacher of an fp32
    student counts as the same). Three tensors (first, middle, last by name) are compared
    first, so different models are told apart without reading them all. Compares on the
    calling process (rank 0 holds the student's weights when it is sharded later)."""
    s, t = _comparable_state(student), teacher.state_dict()
    if s.keys() != t.keys() or any(s[k].shape != t[k].shape for k in s) or not s:
        return False
    keys = sorted(s)
    for k in [keys[0], keys[len(keys) // 2], keys[-1], *keys]:
        a, b = s[k], t[k]
        if a.is_meta or b.is_meta:
            return False
        if not torch.equal(b.detach().cpu(), a.detach().to("cpu", b.dtype)):
            return False
    return True


def _forward_head(model, rollout: Rollout, autocast, head_fn, sel: torch.Tensor):
    """`rollout.sampler.completion_head`: `head_fn` on the (N, H) hidden states that predict the
    completion tokens where the (B, T) bool `sel` is True, through `model`'s own forward (FSDP2's
    hooks gather the head), packed padding-free where rows are uneven. Raises ConfigError for a
    model without a linear LM head."""
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        raise ConfigError(
            f"loss.divergence: {type(model).__name__} has no linear LM head; full-distribution "
            "divergences need one (use loss.divergence reverse_kl_sampled)"
        )
    return completion_head(model, rollout, head_fn, sel, autocast)


class Distill(Trainer):
    """Distillation under the run harness (rlhflab.trainers.loop)."""

    name = "distill"
    headline = ("distill/kl", "rollout/accuracy", "eval/accuracy")
    writes_samples = True

    # -- Set-up (validation only, nothing written) ---------------------------------------------
    def __init__(self, cfg: DistillConfig, env: Env) -> None:
        """Prompts, student, teacher (tokenizer checked), sampler, optimizer, RNGs."""
        super().__init__(cfg, env)
        device, t = env.device, cfg.task
        self.prompts = prompts = PromptSet(cfg, seed=cfg.seed)
        splits = self.splits = prompts.splits
        self.is_task = prompts.is_task
        tokenizer, model = prepare_model(
            cfg.model, device=device, seed=cfg.seed,
            tokenizer_texts=lambda: prompts.tokenizer_texts(cfg.model.build.tokenizer_texts),
            sharded_later=True,
        )  # fmt: skip
        self.tokenizer = tokenizer
        self.context = context_length(model)
        prompts.encode(tokenizer, context=self.context, seed=cfg.seed,
                       max_new_tokens=cfg.rollout.max_new_tokens,
                       allow_change=cfg.run.allow_config_change)  # fmt: skip
        self.verifier = Verifier(
            answer_format=t.answer_format, reward=t.reward, extractor=t.extractor
        )
        self.heldout = splits.heldout[: cfg.eval.n] if self.is_task else []
        self.baseline = (
            majority_baseline(splits.train, self.heldout, self.verifier) if self.is_task else None
        )
        distributed.check_split(
            cfg.rollout.prompts_per_step * cfg.rollout.group_size, "rollout.prompts_per_step",
            "completions",
        )  # fmt: skip
        model = apply_lora(model, cfg.model.lora)
        self.divergence = DIVERGENCES[cfg.loss.divergence]
        self.teacher = None
        if cfg.teacher.source == "model":
            self.teacher = self.load_teacher(tokenizer, model, device)
        model = distributed.wrap(model, cfg.parallel)
        self.model, self.tokenizer = model, tokenizer
        r = cfg.rollout
        self.group_size = r.group_size
        self.batch_size = r.prompts_per_step * r.group_size
        self.optimizer = make_optimizer(model, cfg.optim)
        self.scheduler = make_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.mix_rng = torch.Generator().manual_seed(cfg.seed + 2)  # GKD: student or teacher
        # Batches (rlhflab.experience): sampled by the student in the configured mode (sync,
        # dynamic sampling, async; episodes with an `env`), scored by the verifier only; GKD's
        # off-policy batches sampled by the teacher (`Sampler.draw_from`).
        self.sampler = Sampler(
            cfg, prompts, model, tokenizer, VerifierOnly(self.verifier, is_task=self.is_task),
            device=device, autocast_dtype=env.autocast_dtype, context=self.context,
        )  # fmt: skip
        self.initial_eval: dict = {}
        self.final_eval: dict = {}

    def load_teacher(self, tokenizer, student, device) -> torch.nn.Module:
        """The frozen teacher on `device`, in the student's compute dtype (module doc)."""
        from rlhflab.errors import ModelError
        from rlhflab.models.loading import default_attn_implementation, load_model, load_tokenizer

        tc, cfg = self.cfg.teacher, self.cfg
        path = teacher_path(tc.name_or_path)
        dtype = tc.dtype
        if dtype == "auto":
            student_dtype = next(student.parameters()).dtype
            bf16 = self.autocast_dtype == torch.bfloat16 or cfg.parallel.mixed_precision == "bf16"
            dtype = (
                "bfloat16" if bf16 else "float64" if student_dtype == torch.float64 else "float32"
            )
        try:
            teacher_tok = load_tokenizer(path, trust_remote_code=tc.trust_remote_code)
            teacher = load_model(
                path, dtype=dtype, trust_remote_code=tc.trust_remote_code, device=str(device),
                attn_implementation=default_attn_implementation(device),
            )  # fmt: skip
        except ModelError as exc:
            raise ModelError(f"teacher.name_or_path: {exc}") from None
        student_name = cfg.model.name_or_path or "model.build"
        check_causal_lm(teacher, tc.name_or_path)
        check_same_tokenizer(tokenizer, teacher_tok, student_name, tc.name_or_path)
        v_s = student.get_output_embeddings().weight.size(0)
        v_t = teacher.get_output_embeddings().weight.size(0)
        if v_s != v_t:
            raise ConfigError(
                f"teacher.name_or_path: the teacher's LM head has {v_t} rows, the student's "
                f"({student_name}) {v_s}: the vocabularies must have the same size"
            )
        self._check_not_the_student(student, teacher, student_name)
        teacher.eval().requires_grad_(False)
        return distributed.wrap(teacher, cfg.parallel)

    def _check_not_the_student(self, student, teacher, student_name: str) -> None:
        """Refuse (or, with `teacher.allow_same_as_student`, warn about) a teacher holding the
        student's own weights (module doc). Decided on rank 0, which holds the student's
        weights; every rank learns it."""
        tc = self.cfg.teacher
        what = (
            f"teacher.name_or_path: the teacher ({tc.name_or_path}) has the student's own "
            f"weights ({student_name}): the KL is 0 and its gradient float noise, which AdamW "
            "turns into full-size updates"
        )

        def decide() -> bool:
            same = same_weights(student, teacher)
            if same and not tc.allow_same_as_student:
                raise ConfigError(
                    f"{what}; set teacher.allow_same_as_student: true to run it anyway"
                )
            return same

        if distributed.main_then_share(decide) and distributed.is_main():
            warnings.warn(f"{what} (teacher.allow_same_as_student is set)", stacklevel=2)

    def describe(self) -> str:
        teacher = self.cfg.teacher.name_or_path or "self (correct sibling as demonstration)"
        return (
            f"teacher {teacher}, divergence {self.cfg.loss.divergence}, train prompts "
            f"{len(self.prompts.ids)}, held-out {len(self.heldout)}"
        )

    def checkpointed(self) -> Checkpointed:
        return Checkpointed.one_model(
            self.model, self.optimizer, self.scheduler, self.prompts.stream,
            generators={**self.sampler.generators(), "mix": self.mix_rng},
        )  # fmt: skip

    # -- Evaluations, state ----------------------------------------------------------------------
    def has_heldout(self) -> bool:
        return bool(self.heldout)

    def evaluate(self, step: int) -> dict:
        if self.sampler.env is not None:  # episodes (greedy): success, turns, tool calls
            res = self.sampler.evaluate_episodes(self.heldout, batch_size=self.cfg.eval.batch_size)
            self.tracker.log(step, {f"eval/{k}": v for k, v in res.items()})
        else:
            with self.sampler.evaluating() as engine:
                res = heldout_eval(
                    self.cfg, self.model, self.tokenizer, self.heldout, self.verifier,
                    self.tracker, step, self.autocast_dtype, system=self.prompts.system,
                    instruction=self.prompts.instruction, baseline=self.baseline, engine=engine,
                )  # fmt: skip
        self.health.observe_eval(step, res)
        return res

    def begin(self) -> None:
        self.initial_eval = self.evaluate(0) if self.heldout else {}

    def state(self) -> dict:
        # first: waits for the queued rollouts (async), which move the RNG, stream and counters
        return {**self.sampler.state(), "initial_eval": self.initial_eval,
                "verifier_errors": self.verifier.n_errors}  # fmt: skip

    def load_state(self, state: dict) -> None:
        self.initial_eval = state["initial_eval"]
        self.verifier.n_errors = state["verifier_errors"]
        self.sampler.load(state)

    def write_samples(self, step: int) -> None:
        cfg = self.cfg
        if step % cfg.tracking.samples_every == 0 or step == 1:
            b = self.last_batch
            n = min(cfg.tracking.samples_per_step, len(b.texts))
            self.samples.write(step, [
                {"prompt": getattr(b.problems[i], "question", None), "completion": b.texts[i],
                 "reward": b.rewards[i].item(), "answer": getattr(b.problems[i], "answer", None)}
                for i in range(n)
            ])  # fmt: skip

    # -- One step --------------------------------------------------------------------------------
    def step(self, step: int) -> tuple[dict, dict]:
        cfg = self.cfg
        on_policy = True
        if cfg.loss.lmbda < 1:  # GKD: the same draw on every rank (same seed, same stream)
            on_policy = bool(torch.rand((), generator=self.mix_rng).item() < cfg.loss.lmbda)
        info: dict = {}
        timer = self.timer
        verifier_errors = None  # sampled ahead (async): the count as of the batch
        with timer.stage("rollout"):
            if cfg.teacher.source == "self":
                batch, info = self.sdpo_batch(step)
                t_rollout, keep = self.sibling_rollout(batch)
            elif on_policy:  # the student samples, in the configured mode (rlhflab.experience)
                batch, info = self.sampler.next_batch(step, self.model)
                verifier_errors = info.pop("verifier_errors")  # as of that batch (async)
                info = {f"rollout/{k}": v for k, v in info.items()}
                t_rollout, keep = batch.rollout, torch.ones_like(batch.rewards)
            else:  # GKD's off-policy batch: the teacher samples
                chosen = self.prompts.stream.take(cfg.rollout.prompts_per_step)
                batch = self.sampler.draw_from(self.teacher, chosen, step)
                t_rollout, keep = batch.rollout, torch.ones_like(batch.rewards)
        local = batch.rollout.attention_mask  # the global batch; this rank trains 1/world of it
        tokens = float(local.sum()) / distributed.world_size()
        timer.count(
            generated=float(batch.rollout.mask.sum()), trained=float(batch.rollout.mask.sum())
        )
        timer.forward("rollout", tokens, local.size(1))
        timer.train("update", tokens, local.size(1))  # the student's; the teacher's not counted
        with timer.stage("update"):  # the teacher's forward passes run inside the update
            stats = self.update(batch.rollout, t_rollout, keep, step)
        with timer.stage("weight_sync"):
            self.sampler.sync_weights(self.model)
        self.last_batch = batch
        mask = batch.rollout.mask
        if verifier_errors is None:
            verifier_errors = self.verifier.n_errors
        # the verifier's score; with an `env`, the environment's reward (its success rate is
        # rollout/success)
        episodes = self.sampler.env is not None
        metrics = {
            **stats,
            "distill/on_policy": float(on_policy),
            "rollout/reward_mean" if episodes else "rollout/accuracy": batch.rewards.mean().item(),
            "rollout/response_length": mask.sum(1).mean().item(),
            "rollout/truncated_frac": batch.rollout.truncated.float().mean().item(),
            "optim/lr": self.scheduler.get_last_lr()[0],
            "verifier/errors": verifier_errors,
            **info,
            **batch.info,  # episodes: rollout/success, rollout/turns_mean, ...
        }
        health_inputs = {
            "rollout": batch.rollout,
            "texts": batch.texts,
            "group_size": self.group_size,
            "correct": batch.rewards if self.is_task and not episodes else None,
        }
        return metrics, health_inputs

    def sdpo_batch(self, step: int) -> tuple[ScoredBatch, dict]:
        """The book's SDPO batch: draws of prompts_per_step prompts until prompts_per_step groups
        hold a correct completion (groups without one are skipped), at most sdpo.max_rounds draws.

        Raises:
            DataError: the batch is not full after sdpo.max_rounds draws.
        """
        cfg, g = self.cfg, self.group_size
        need, kept, n_kept, drawn = cfg.rollout.prompts_per_step, [], 0, 0
        for rounds in itertools.count(1):
            if rounds > cfg.sdpo.max_rounds:
                raise DataError(
                    f"step {step}: SDPO found a correct completion for only {n_kept} of the "
                    f"{need} prompts a batch needs after {cfg.sdpo.max_rounds} draws of {need} "
                    "prompts (sdpo.max_rounds); raise sdpo.max_rounds or rollout.group_size, or "
                    "start from a stronger student"
                )
            b = self.sampler.draw(self.prompts.stream.take(need), step)
            drawn += need
            solved = (b.rewards.view(-1, g) >= 1.0).any(1).nonzero().flatten().cpu()
            take = solved[: need - n_kept]
            if take.numel():
                kept.append(b.select_groups(take, g))
                n_kept += take.numel()
            if n_kept == need:
                break
        batch = ScoredBatch.concat(kept, self.tokenizer.pad_token_id)
        return batch, {"sdpo/rounds": float(rounds), "sdpo/skipped_prompts": float(drawn - need)}

    def sibling_rollout(self, batch: ScoredBatch) -> tuple[Rollout, torch.Tensor]:
        """SDPO's teacher rollout: each row's prompt with the question followed by the first other
        correct completion of its group as a demonstration (the book's reprompt; the "other"
        sibling rule of its earlier LiveCodeBench rollout.py, see the module doc), and the same
        completion tokens; `keep` (B,) is 0 for rows with no such sibling."""
        g, rows, keep = self.group_size, [], []
        correct = (batch.rewards >= 1.0).tolist()
        for i, problem in enumerate(batch.problems):
            base = i - i % g
            demo = next((j for j in range(base, base + g) if j != i and correct[j]), None)
            keep.append(float(demo is not None))
            if demo is None:
                rows.append(self.prompts.ids[0][:1])  # not scored (keep 0): any short prompt
                continue
            question = (
                f"{problem.question}\nCorrect solution:\n\n{batch.texts[demo]}\n"
                "\nCorrectly solve the original question.\n"
            )
            row = dataclasses.replace(problem, prompt=question)
            ids = encode_prompt(self.tokenizer, self.prompts.render(self.tokenizer, row))
            if len(ids) + self.cfg.rollout.max_new_tokens > self.context:
                raise DataError(
                    f"SDPO teacher prompt of {len(ids)} tokens (question + demonstration) and "
                    f"rollout.max_new_tokens {self.cfg.rollout.max_new_tokens} exceed the model's "
                    f"context of {self.context} tokens; lower rollout.max_new_tokens"
                )
            rows.append(ids)
        r = batch.rollout
        prompt_ids, prompt_mask = left_pad(rows, self.tokenizer.pad_token_id)
        dev = r.prompt_ids.device
        teacher = Rollout(prompt_ids.to(dev), prompt_mask.to(dev), r.completion_ids, r.mask,
                          r.logp, r.truncated)  # fmt: skip
        return teacher, torch.tensor(keep, device=r.mask.device)

    def update(self, rollout: Rollout, t_rollout: Rollout, keep: torch.Tensor, step: int) -> dict:
        """One optimizer step on the token mean of the divergence over the global batch (rows with
        keep 0 left out), accumulated over this rank's micro-batches; returns the step's metrics."""
        mask_all = rollout.mask * keep[:, None]
        num_tokens = mask_all.sum().clamp_min(1.0)  # the global batch's scored tokens
        self.optimizer.zero_grad(set_to_none=True)
        kl, agree = [], []
        # A teacher model stays gathered (whole on every rank under FSDP2) through the backward
        # passes, which recompute each chunk's teacher logits from its head.
        with distributed.gathered(self.teacher):
            loss_sum = self._accumulate(rollout, t_rollout, mask_all, num_tokens, step, kl, agree)
        faults.hit("step_mid", step)
        return self._finish_update(loss_sum, kl, agree, step)

    def _accumulate(self, rollout, t_rollout, mask_all, num_tokens, step, kl, agree) -> float:
        """The backward passes of this rank's micro-batches (update's loop); returns the summed
        loss and appends the per-token KL and agreement to `kl` and `agree`."""
        r0, r1 = distributed.shard_bounds(self.batch_size)
        loss_sum = 0.0
        rows_all = list(range(r0, r1))
        w_s, w_t = rollout.widths(), t_rollout.widths()  # the wider of the two prompts' layouts
        widths = [(max(w_s[i][0], w_t[i][0]), w_s[i][1]) for i in rows_all]
        for rows, weight in micro_batches(self.cfg.train, rows_all, widths, pad_row=r0):
            idx = torch.tensor(rows, device=rollout.mask.device)
            # at the micro-batch's own widths (Rollout.trimmed; student and teacher share the
            # completion tokens and mask, so both keep the same completion columns)
            s, t = rollout.select(idx).trimmed(), t_rollout.select(idx).trimmed()
            m = mask_all[idx][:, : s.mask.size(1)]
            div, kl_tok, agree_tok = self.token_terms(s, t, m)
            loss = div.sum() / num_tokens  # div: 0 off the scored tokens
            loss = faults.corrupt("loss", step, loss) * weight
            loss.backward()
            loss_sum += float(loss.detach())
            if weight:
                kl.append(kl_tok)
                agree.append(agree_tok)
        return loss_sum

    def _finish_update(self, loss_sum, kl, agree, step) -> dict:
        """The optimizer step after the backward passes; returns the step's metrics."""
        cfg = self.cfg
        loss_sum = distributed.sum_dict({"loss": loss_sum})["loss"]
        grad_norm = grad_norm_and_clip(self.model, cfg.optim.max_grad_norm)
        if self.guard.check(step, {"train/loss": loss_sum, "optim/grad_norm": grad_norm}):
            self.optimizer.step()
            self.scheduler.step()
        kl_all = distributed.gather_cat(torch.cat(kl).float())
        out = {"train/loss": loss_sum, "optim/grad_norm": float(grad_norm),
               "distill/kl": kl_all.mean().item() if kl_all.numel() else 0.0}  # fmt: skip
        if self.divergence.needs == "full" and kl_all.numel():
            qs = torch.tensor(KL_QUANTILES, dtype=kl_all.dtype, device=kl_all.device)
            q = torch.quantile(kl_all, qs)
            for p, v in zip(KL_QUANTILES, q.tolist(), strict=True):
                out[f"distill/kl_p{round(100 * p)}"] = v
            out["distill/kl_max"] = kl_all.max().item()
            out["distill/argmax_agree"] = (
                distributed.gather_cat(torch.cat(agree).float()).mean().item()
            )
        return out

    def token_terms(self, s: Rollout, t: Rollout, mask: torch.Tensor):
        """For one micro-batch: the divergence per token (b, T), 0 off the scored tokens
        (`mask` > 0), with gradient; and detached the per-token KL(student ‖ teacher) (exact; the
        k1 estimate for the sampled estimator) and the argmax agreement (N,) (empty for the
        sampled estimator)."""
        cfg, dev = self.cfg, mask.device
        autocast = torch.autocast(dev.type, dtype=self.autocast_dtype,
                                  enabled=self.autocast_dtype is not None)  # fmt: skip
        teacher = self.teacher if self.teacher is not None else self.model
        # a teacher model is gathered by `update`; the self-teacher (the student) is gathered here
        gather = (
            distributed.gathered(self.model) if self.teacher is None else contextlib.nullcontext()
        )
        sel = mask > 0
        if self.divergence.needs == "sampled":
            logp, _ = completion_logps(self.model, s, temperature=cfg.rollout.temperature,
                                       autocast_dtype=self.autocast_dtype)  # fmt: skip
            with torch.no_grad(), gather:
                logp_t, _ = completion_logps(teacher, t, temperature=cfg.rollout.temperature,
                                             autocast_dtype=self.autocast_dtype)  # fmt: skip
            loss_tok, k1 = self.divergence(logp, logp_t)
            return loss_tok * sel, k1[sel], k1.new_zeros(0)
        with torch.no_grad(), gather:
            h_t = _forward_head(teacher, t, autocast, lambda h: h.detach(), sel)  # (N, H)
        args, extra = cfg.loss.divergence_args, {}
        t_head = teacher.get_output_embeddings()

        def head_fn(hidden):  # (N, H): the student's predictions of the scored tokens -> (N,)
            head = self.model.get_output_embeddings()
            div, extra["kl"], extra["agree"] = chunked_divergence(
                hidden, head.weight, h_t, t_head.weight, self.divergence.fn,
                bias_s=head.bias, bias_t=t_head.bias, temperature=cfg.rollout.temperature,
                chunk_size=cfg.loss.chunk_size, **args,
            )  # fmt: skip
            return div

        div = _forward_head(self.model, s, autocast, head_fn, sel)  # (N,)
        grid = torch.zeros(sel.shape, dtype=div.dtype, device=div.device)
        return grid.index_put(sel.nonzero(as_tuple=True), div), extra["kl"], extra["agree"]

    # -- The end -------------------------------------------------------------------------------
    def finish(self, step: int) -> None:
        self.sampler.close()
        self.final_eval = self.evaluate(step) if self.heldout else {}

    def results(self) -> dict:
        fe, ie = self.final_eval, self.initial_eval
        return {
            "heldout_accuracy_before": ie.get("accuracy"),
            "heldout_accuracy": fe.get("accuracy"),
            "heldout_accuracy_stderr": fe.get("accuracy_stderr"),
            "heldout_n": fe.get("n", 0),
            **majority_results(self.baseline),
            "heldout_overlap_dropped": self.splits.n_heldout_overlap_dropped,
            "teacher": self.cfg.teacher.name_or_path or "self",
            "divergence": self.cfg.loss.divergence,
            "verifier_errors": self.verifier.n_errors,
        }

"""Config of `trainer: distill`: on-policy distillation, GKD and the book's SDPO (see
rlhflab.trainers.distill and docs/distillation.md)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from rlhflab.config.base import Strict, _check_kwargs, _check_name
from rlhflab.config.policy_gradient import (
    EnvConfig,
    PGTrainConfig,
    RolloutConfig,
    check_env_prompts,
    check_sampling_modes,
)
from rlhflab.config.sections import EvalConfig, OptimConfig, PromptDataConfig, TrainerConfig


class TeacherConfig(Strict):
    """Who teaches. `source` "model": `name_or_path` is a run directory (its `model/`), a local
    model directory or a hub id, with the student's tokenizer (compared; cross-tokenizer
    distillation is not supported); it is frozen, scored without gradients and, where the
    student computes in bf16, held in bf16. `source` "self" (the book's SDPO): the teacher is the
    student itself, prompted with the question and a correct sibling completion as a
    demonstration."""

    source: Literal["model", "self"] = "model"
    name_or_path: str | None = None
    # "auto": bfloat16 when the student computes in bf16 (precision.autocast / parallel
    # mixed_precision), else float32
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    trust_remote_code: bool = False
    # A teacher with the student's own weights is refused (its KL gradient is float noise that
    # AdamW scales up to full-size updates); true runs it anyway, with a warning (a control run).
    allow_same_as_student: bool = False

    @model_validator(mode="after")
    def _path(self) -> TeacherConfig:
        if self.source == "model" and not self.name_or_path:
            raise ValueError("teacher.name_or_path is required when teacher.source is 'model'")
        if self.source == "self" and self.name_or_path:
            raise ValueError(
                "teacher.name_or_path: must be unset when teacher.source is 'self' "
                "(the student teaches itself)"
            )
        return self


class DistillLossConfig(Strict):
    """The per-token divergence (rlhflab.losses.distill.DIVERGENCES) and its arguments, averaged
    over the batch's completion tokens (TRL's "batchmean" over labels)."""

    divergence: str = "reverse_kl"
    divergence_args: dict[str, Any] = Field(default_factory=dict)
    # GKD's λ: the probability that a step's batch is sampled from the student (on-policy); else
    # from the teacher (sequence-level KD on teacher outputs). 1.0: on-policy distillation.
    lmbda: float = Field(1.0, ge=0, le=1)
    chunk_size: int = Field(1024, ge=1)  # completion tokens per chunk of logits

    @model_validator(mode="after")
    def _names_and_args(self) -> DistillLossConfig:
        from rlhflab.losses.distill import DIVERGENCES

        _check_name("loss.divergence", self.divergence, DIVERGENCES)
        entry = DIVERGENCES[self.divergence]
        if entry.needs == "sampled":
            if self.divergence_args:
                raise ValueError(f"loss.divergence_args: '{self.divergence}' takes none")
        else:
            _check_kwargs("loss.divergence_args", entry.fn, self.divergence_args, set())
        beta = self.divergence_args.get("beta")
        if beta is not None and not (isinstance(beta, int | float) and 0 <= beta <= 1):
            raise ValueError(f"loss.divergence_args.beta must be in [0, 1], got {beta!r}")
        k = self.divergence_args.get("top_k")
        if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
            raise ValueError(f"loss.divergence_args.top_k must be an integer >= 1, got {k!r}")
        direction = self.divergence_args.get("direction")
        if direction is not None and direction not in ("forward", "reverse"):
            raise ValueError(
                f"loss.divergence_args.direction must be 'forward' or 'reverse', got {direction!r}"
            )
        if entry.student_samples and self.lmbda < 1:
            raise ValueError(
                f"loss.lmbda: '{self.divergence}' is valid on student samples only; use "
                "lmbda 1 or a full-distribution divergence"
            )
        return self


class SDPOConfig(Strict):
    """The book's SDPO batch: prompts with no correct sibling completion are skipped and further
    prompts are drawn until the batch holds rollout.prompts_per_step usable prompts."""

    max_rounds: int = Field(8, ge=1)  # draws of prompts_per_step prompts per step; then a DataError


class DistillConfig(TrainerConfig):
    """Config of `trainer: distill` (see trainers/distill.py)."""

    #: the `rollout` keys the distillation trainer reads: every sampling mode of
    #: `rlhflab.experience.Sampler` (sync, async with max_staleness, dynamic sampling) through
    #: either engine; not behav_correction / behav_cap (they reweight a policy-gradient loss by
    #: π_prox/π_behav; the divergence reads no sampler log-probs)
    ROLLOUT_KEYS: ClassVar[frozenset[str]] = frozenset({
        "prompts_per_step", "group_size", "max_new_tokens", "temperature", "top_p", "top_k",
        "min_p", "stop_token_ids", "engine", "vllm", "decode", "sync_every", "cuda_graph",
        "half_weights", "mode", "max_staleness", "async_worker", "dynamic_sampling",
    })  # fmt: skip

    trainer: Literal["distill"] = "distill"
    teacher: TeacherConfig
    loss: DistillLossConfig = Field(default_factory=DistillLossConfig)
    rollout: RolloutConfig = Field(default_factory=lambda: RolloutConfig(group_size=1))
    sdpo: SDPOConfig = Field(default_factory=SDPOConfig)
    data: PromptDataConfig = Field(default_factory=PromptDataConfig)
    train: PGTrainConfig = Field(default_factory=PGTrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    # multi-turn episodes (docs/multiturn.md): the student plays them, the teacher scores every
    # model token of the trajectory in its context (observations attended, never trained on)
    env: EnvConfig | None = None

    @model_validator(mode="after")
    def _consistency(self) -> DistillConfig:
        check_sampling_modes(self.rollout, self.env)
        check_env_prompts(self.env, self.data)
        modes = [
            (self.rollout.mode == "async", "rollout.mode 'async'"),
            (self.rollout.dynamic_sampling.enabled, "rollout.dynamic_sampling"),
            (self.env is not None, "env"),
        ]
        if self.rollout.dynamic_sampling.enabled and self.data.source != "task":
            raise ValueError(
                "rollout.dynamic_sampling: distillation keeps the groups whose verifier scores "
                "vary, and data.source 'dataset' has no verifier (every score is 0)"
            )
        for used, key in modes:
            if used and self.teacher.source == "self":
                raise ValueError(
                    f"{key}: teacher.source 'self' (SDPO) draws its own batches (sdpo.max_rounds) "
                    "from synchronous single-turn samples"
                )
            if used and self.loss.lmbda < 1 and key != "rollout.dynamic_sampling":
                raise ValueError(
                    f"{key}: loss.lmbda < 1 (GKD) samples the off-policy batches from the teacher "
                    "synchronously and single-turn; use loss.lmbda 1"
                )
        if self.teacher.source == "self":
            if self.rollout.group_size < 2:
                raise ValueError(
                    "rollout.group_size must be >= 2 for teacher.source 'self' (the "
                    f"demonstration is a correct sibling in the group; got {self.rollout.group_size})"
                )
            if self.data.source != "task":
                raise ValueError(
                    "teacher.source 'self' needs data.source 'task' (its verifier picks the "
                    "correct siblings)"
                )
            if self.loss.lmbda < 1:
                raise ValueError("loss.lmbda: teacher.source 'self' samples from the student only")
        if self.train.update_epochs != 1 or self.train.minibatches != 1:
            raise ValueError(
                "train.update_epochs and train.minibatches: distillation takes one optimizer step "
                "per batch (both must be 1)"
            )
        if self.loss.lmbda < 1 and self.rollout.engine != "hf":
            raise ValueError(
                "loss.lmbda < 1 samples from the teacher with rollout.engine 'hf' only"
            )
        return self

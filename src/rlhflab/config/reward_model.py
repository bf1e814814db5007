"""Config of `trainer: reward_model`: preference, outcome and process reward models (see
rlhflab.trainers.reward_model)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhflab.config.base import Strict, _check_micro
from rlhflab.config.sections import MAX_SECONDS_DOC, OptimConfig, TrainBase, TrainerConfig

# ---------------------------------------------------------------------------------------------
# Reward models (preference / outcome / process)
# ---------------------------------------------------------------------------------------------


class RMDataConfig(Strict):
    """Where the reward model's labelled data comes from.

    task_samples      the policy `data.policy` samples `samples_per_prompt` completions for
                      `n_prompts` task prompts; the verifier labels them (pairs / outcomes / steps)
    worked_solutions  arithmetic worked solutions with planted errors (orm / prm; no policy)
    preference        a preference dataset (`path`, `format`: auto, implicit, ultrafeedback,
                      hh_rlhf, pairs)
    prm800k           PRM800K rows (`path`: file or hub id)
    step_labelled     solutions with a rating per step and an outcome (`path`; orm / prm;
                      `rlhflab.data.prm.load_step_labelled`)
    """

    source: Literal[
        "task_samples", "worked_solutions", "preference", "prm800k", "step_labelled"
    ] = "task_samples"
    policy: str | None = None  # task_samples: the sampling policy (default: model.name_or_path)
    n_prompts: int = Field(256, ge=1)
    samples_per_prompt: int = Field(8, ge=1)
    max_new_tokens: int = Field(48, ge=1)
    temperature: float = Field(1.0, gt=0)
    max_pairs_per_prompt: int = Field(4, ge=1)
    error_frac: float = Field(0.5, ge=0, le=1)  # worked_solutions: share with a planted error
    path: str | None = None
    format: Literal["auto", "implicit", "ultrafeedback", "hh_rlhf", "pairs"] = "auto"
    split: str = "train"
    max_rows: int | None = Field(None, ge=1)
    heldout_frac: float = Field(0.1, ge=0, lt=1)  # preference / prm800k: rows held out for eval
    on_invalid: Literal["error", "drop"] = "error"
    step_separator: str = "\n"
    max_len: int = Field(256, ge=8)


class RMLossConfig(Strict):
    """Loss hyperparameters (rlhflab.losses.reward_model)."""

    margin: float | None = None  # bradley_terry margin m
    center_coef: float = Field(0.0, ge=0)  # bradley_terry centring η
    orm_loss: Literal["orm_bce", "orm_seq_bce"] = "orm_bce"
    num_classes: Literal[2, 3] = 2  # prm: binary or {−1, 0, +1}
    prm_reduce: Literal["min", "prod"] = "min"


class RMTrainConfig(TrainBase):
    """Reward-model budget: steps, examples per step and per micro-batch."""

    steps: int = Field(100, ge=1)
    batch_size: int = Field(32, ge=1)  # pairs (preference) or sequences (orm / prm) per step
    micro_batch_size: int = Field(32, ge=1)
    max_seconds: float | None = Field(None, gt=0, description=MAX_SECONDS_DOC)


class RMEvalConfig(Strict):
    """Held-out RM metrics after training; best-of-N needs a policy and a task."""

    best_of_n: list[int] = Field(default_factory=list)  # e.g. [1, 2, 4, 8]; empty: skip
    n_problems: int = Field(64, ge=1)
    max_new_tokens: int = Field(48, ge=1)
    temperature: float = Field(1.0, gt=0)
    batch_size: int = Field(256, ge=1)


class RMConfig(TrainerConfig):
    """Config of `trainer: reward_model` (see trainers/reward_model.py)."""

    trainer: Literal["reward_model"] = "reward_model"
    kind: Literal["preference", "orm", "prm"] = "preference"
    data: RMDataConfig = Field(default_factory=RMDataConfig)
    loss: RMLossConfig = Field(default_factory=RMLossConfig)
    train: RMTrainConfig = Field(default_factory=RMTrainConfig)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4))
    eval: RMEvalConfig = Field(default_factory=RMEvalConfig)

    @model_validator(mode="after")
    def _consistency(self) -> RMConfig:
        _check_micro(self.train.batch_size, self.train.micro_batch_size, "train")
        src, kind = self.data.source, self.kind
        if src == "preference" and kind != "preference":
            raise ValueError(f"data.source 'preference' trains kind 'preference', not {kind!r}")
        if src == "prm800k" and kind != "prm":
            raise ValueError(f"data.source 'prm800k' trains kind 'prm', not {kind!r}")
        if src == "worked_solutions" and kind == "preference":
            raise ValueError("data.source 'worked_solutions' trains kind 'orm' or 'prm'")
        if src == "step_labelled" and kind == "preference":
            raise ValueError("data.source 'step_labelled' trains kind 'orm' or 'prm'")
        if src in ("preference", "prm800k", "step_labelled") and not self.data.path:
            raise ValueError(f"data.path is required when data.source is {src!r}")
        if src == "task_samples" and not (self.data.policy or self.model.name_or_path):
            raise ValueError("data.policy (or model.name_or_path) is needed to sample task data")
        if self.model.lora is not None and self.model.lora.save == "adapter":
            raise ValueError(
                "model.lora.save: a reward model is saved merged (its score head is "
                "trained in full), not as an adapter directory"
            )
        return self

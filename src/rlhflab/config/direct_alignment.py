"""Config of `trainer: direct_alignment`: DPO and relatives, on preference files or on pairs
sampled from the policy (see rlhflab.trainers.direct_alignment)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlhflab.config.base import Strict, _check_kwargs, _check_micro, _check_name
from rlhflab.config.sections import (
    MAX_SECONDS_DOC,
    EvalConfig,
    OptimConfig,
    PromptDataConfig,
    RewardComponentConfig,
    TrainBase,
    TrainerConfig,
)

# ---------------------------------------------------------------------------------------------
# Direct alignment (DPO and relatives)
# ---------------------------------------------------------------------------------------------


class DPODataConfig(Strict):
    """Preference pairs from a file / hub dataset, or verifiable pairs sampled from the policy.

    source "file": `path` (hub id, dataset directory or .json/.jsonl/.parquet/.csv) in `format`
    ("auto": detected from the rows; see rlhflab.data.preference); `heldout_pairs` of them (after
    a seeded shuffle) are held out.
    source "verifiable": per round, `verifiable.n_prompts` task prompts, K samples each from the
    current policy, best vs worst by the task's verifier (see VerifiablePairsConfig).
    """

    source: Literal["file", "verifiable"] = "verifiable"
    path: str | None = None
    format: Literal["auto", "implicit", "ultrafeedback", "hh_rlhf", "pairs", "unpaired"] = "auto"
    split: str = "train"
    max_rows: int | None = Field(None, ge=1)
    on_invalid: Literal["error", "drop"] = "error"
    heldout_pairs: int = Field(
        64, ge=0
    )  # held-out preference pairs (accuracy every eval.pref_every)
    max_prompt_len: int | None = Field(None, ge=1)
    max_completion_len: int | None = Field(None, ge=1)
    truncation_side: Literal["left", "right"] = "left"  # of the prompt; "left" keeps its end

    @model_validator(mode="after")
    def _path_for_file(self) -> DPODataConfig:
        if self.source == "file" and not self.path:
            raise ValueError("data.path is required when data.source is 'file'")
        return self


class VerifiablePairsConfig(Strict):
    """Pairs sampled from the policy and labelled by the task's verifier (online when rounds > 1).

    Each round: sample `samples_per_prompt` completions for each of `n_prompts` training prompts,
    pair the best with the worst (`chosen`: "sampled" best, "gold" reference answer, or
    "sampled_or_gold": the best sample if it beats the worst, else the gold answer), recompute
    reference log-probs with the policy as it is at the start of the round, train
    train.steps / rounds steps. rounds = 1 is offline DPO on pairs from the initial model.
    """

    n_prompts: int = Field(512, ge=1)
    samples_per_prompt: int = Field(8, ge=2)
    # How samples are scored: None, the task's verifier; else reward components (reward
    # functions, a reward model, ...) summed with weights, as in the policy-gradient trainer.
    reward: list[RewardComponentConfig] | None = None
    chosen: Literal["sampled", "gold", "sampled_or_gold"] = "sampled_or_gold"
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(24, ge=1)
    rounds: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _one_reward_per_sample(self) -> VerifiablePairsConfig:
        for comp in self.reward or []:
            if comp.dense:
                raise ValueError(
                    "verifiable.reward: credit 'dense' gives per-token rewards; pairs are ranked "
                    "by one reward per sample (use credit 'sequence')"
                )
        return self


class DPOLossConfig(Strict):
    """`name` is a key of rlhflab.losses.preference.PREFERENCE_LOSSES, or one of the field's usual
    names in PREFERENCE_ALIASES (TRL's `loss_type` "sigmoid", ...), resolved to ours (which the
    run's config.yaml records); `args` its keyword args (not those the trainer supplies)."""

    name: str = "dpo"
    args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _name_and_args(self) -> DPOLossConfig:
        from rlhflab.losses.preference import PREFERENCE_ALIASES, PREFERENCE_LOSSES

        self.name = PREFERENCE_ALIASES.get(self.name, self.name)
        _check_name("loss.name", self.name, PREFERENCE_LOSSES)
        loss = PREFERENCE_LOSSES[self.name]
        _check_kwargs("loss.args", loss.fn, self.args, loss.trainer_args)
        return self


class DPOTrainConfig(TrainBase):
    """Direct-alignment budget: steps, pairs per step and per micro-batch."""

    steps: int = Field(100, ge=1)  # optimizer steps in total (split evenly over rounds)
    batch_size: int = Field(32, ge=1)  # pairs (KTO: labelled completions) per optimizer step
    micro_batch_size: int = Field(32, ge=1)  # pairs per forward (chosen and rejected together)
    max_seconds: float | None = Field(None, gt=0, description=MAX_SECONDS_DOC)


class DPOEvalConfig(EvalConfig):
    """Held-out task accuracy and held-out preference accuracy of a direct-alignment run."""

    pref_every: int = Field(10, ge=0)  # held-out preference accuracy every N steps (0: ends only)


class DPOConfig(TrainerConfig):
    """Config of `trainer: direct_alignment` (see trainers/direct_alignment.py)."""

    trainer: Literal["direct_alignment"] = "direct_alignment"
    data: DPODataConfig = Field(default_factory=DPODataConfig)
    # data.source "verifiable": where the sampled pairs' prompts come from (task or dataset).
    prompts: PromptDataConfig = Field(default_factory=PromptDataConfig)
    verifiable: VerifiablePairsConfig = Field(default_factory=VerifiablePairsConfig)
    loss: DPOLossConfig = Field(default_factory=DPOLossConfig)
    train: DPOTrainConfig = Field(default_factory=DPOTrainConfig)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    eval: DPOEvalConfig = Field(default_factory=DPOEvalConfig)

    @model_validator(mode="after")
    def _consistency(self) -> DPOConfig:
        _check_micro(self.train.batch_size, self.train.micro_batch_size, "train")
        if self.train.steps % self.verifiable.rounds:
            raise ValueError(
                f"verifiable.rounds ({self.verifiable.rounds}) must divide train.steps "
                f"({self.train.steps})"
            )
        if self.prompts.source == "dataset" and self.data.source == "verifiable":
            comps = self.verifiable.reward
            if not comps or any(c.name == "correctness" and not c.function for c in comps):
                raise ValueError(
                    "verifiable.reward: pairs sampled on a prompt dataset are labelled by reward "
                    "components (math_verify, a reward function, reward_model), not 'correctness'"
                )
            if self.verifiable.chosen != "sampled":
                raise ValueError(
                    "verifiable.chosen must be 'sampled' with prompts.source 'dataset' "
                    "(there is no gold completion)"
                )
        if self.data.source == "file" and self.verifiable.rounds > 1:
            raise ValueError(
                "verifiable.rounds > 1 needs data.source 'verifiable' (on-policy pairs)"
            )
        if self.data.format == "unpaired" and self.data.source == "file":
            from rlhflab.losses.preference import PREFERENCE_LOSSES, unpaired_loss_names

            if not PREFERENCE_LOSSES[self.loss.name].unpaired:
                raise ValueError(
                    f"data.format 'unpaired' (prompt/completion/label rows) needs loss.name "
                    f"{unpaired_loss_names()}, not '{self.loss.name}'"
                )
        return self

"""Config of `trainer: sft`: supervised fine-tuning (see rlhflab.trainers.sft)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhflab.config.base import Strict, _check_micro
from rlhflab.config.sections import (
    MAX_SECONDS_DOC,
    EvalConfig,
    OptimConfig,
    TrainBase,
    TrainerConfig,
)


class SFTDataConfig(Strict):
    """SFT examples from the task (question -> answer) or from a dataset.

    source "dataset" (alias "jsonl"): `path` is a local .jsonl/.json/.parquet/.csv file, a local
    dataset directory or a Hub id (`split`), with `text`, `messages` or `prompt`/`completion` rows
    (rlhflab.data.sft). `assistant_turns`: which assistant turns of `messages` rows are trained,
    "all" (TRL's assistant_only_loss) or "last". `made_by`: the command that writes `path`,
    named in the error when the file is missing (`check_made`; configs/multiturn/
    calculator_sft.yaml's demonstrations).
    """

    source: Literal["task", "dataset", "jsonl"] = "task"
    path: str | None = None
    split: str = "train"  # of a dataset directory or Hub id
    assistant_turns: Literal["all", "last"] = "all"
    on_invalid: Literal["error", "drop"] = "error"
    # the command that writes `path` (a preset whose data a script makes): the error for a
    # missing `path` shows it; nothing runs it
    made_by: str | None = None

    @model_validator(mode="after")
    def _path_for_jsonl(self) -> SFTDataConfig:
        if self.source != "task" and not self.path:
            raise ValueError(f"data.path is required when data.source is '{self.source}'")
        return self

    def check_made(self) -> None:
        """Before anything is built: a `path` that `made_by` writes must exist.

        Raises:
            DataError: one line naming the file and the command that makes it:
                "data.path: file not found: demos.jsonl; make it with `<made_by>`".
        """
        from pathlib import Path

        from rlhflab.errors import DataError

        if self.source != "task" and self.made_by and not Path(self.path).expanduser().exists():
            raise DataError(
                f"data.path: file not found: {self.path}; make it with `{self.made_by}`"
            )


class SFTTrainConfig(TrainBase):
    """SFT budget: optimizer steps, sequences per step and per micro-batch, max sequence length."""

    steps: int = Field(100, ge=1)
    batch_size: int = Field(64, ge=1)  # sequences per optimizer step
    micro_batch_size: int = Field(64, ge=1)
    max_len: int = Field(256, ge=8)
    max_seconds: float | None = Field(None, gt=0, description=MAX_SECONDS_DOC)


class SFTConfig(TrainerConfig):
    """Config of `trainer: sft` (see trainers/sft.py)."""

    trainer: Literal["sft"] = "sft"
    data: SFTDataConfig = Field(default_factory=SFTDataConfig)
    train: SFTTrainConfig = Field(default_factory=SFTTrainConfig)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-3))
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _micro(self) -> SFTConfig:
        _check_micro(self.train.batch_size, self.train.micro_batch_size, "train")
        return self

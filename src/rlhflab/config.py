"""Typed run configs: one pydantic model per trainer family, loaded from YAML with dotted overrides.

A config file is flat and complete: the file you read is the run you get. Its top-level key
`trainer` names the family (`sft`, `policy_gradient`, ...). Unknown keys are errors that name the
full dotted path and suggest the closest valid key; a loss's keyword arguments are checked against
the function's signature when the config is loaded, not when the loss is first called.

    cfg = load_config("configs/pg/grpo.yaml", ["rollout.group_size=16", "optim.lr=1e-5"])
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlhflab.errors import ConfigError


class Strict(BaseModel):
    """Base for every config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


# ---------------------------------------------------------------------------------------------
# Shared sections
# ---------------------------------------------------------------------------------------------


class BuildConfig(Strict):
    """Build a small model from scratch with a tokenizer trained on the task text."""

    size: str = "base"  # a key of rlhflab.models.build.SIZE_PRESETS
    arch: Literal["qwen3", "llama"] = "qwen3"
    vocab_size: int = Field(1024, ge=263)  # byte-level BPE: 256 bytes + 7 special tokens
    max_position_embeddings: int = Field(512, ge=16)
    tokenizer_texts: int = Field(20000, ge=100)  # task strings to train the tokenizer on


class ModelConfig(Strict):
    """Which causal LM to train: a hub id / local path, or a model built from scratch."""

    name_or_path: str | None = None
    build: BuildConfig | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: str | None = None  # None: flash_attention_2 if installed on GPU, else sdpa
    trust_remote_code: bool = False
    gguf_file: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.name_or_path is None) == (self.build is None):
            raise ValueError("set exactly one of model.name_or_path and model.build")
        return self


class TaskConfig(Strict):
    """A reasoning_gym task as prompt source and verifier, with non-overlapping splits."""

    name: str = "spell_backward"
    config: dict[str, Any] = Field(default_factory=dict)  # the dataset's own kwargs
    n_train: int = Field(20000, ge=1)
    n_heldout: int = Field(500, ge=1)
    seed: int = 0
    answer_format: Literal["tags", "plain"] = "plain"
    reward: Literal["binary", "partial"] = "binary"
    system: str | None = None


class OptimConfig(Strict):
    """AdamW with linear warmup then a schedule; gradients clipped by global norm."""

    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float | None = Field(1.0, gt=0)


class PrecisionConfig(Strict):
    """fp32 master weights; optional bf16 autocast for the forward passes."""

    autocast: Literal["auto", "bf16", "none"] = "none"  # auto: bf16 on CUDA, none on CPU
    threads: int | None = None  # torch.set_num_threads; None leaves torch's default


class TrackingConfig(Strict):
    """Where metrics go. The jsonl file is always written."""

    console: bool = True
    wandb: bool = False
    tensorboard: bool = False
    log_every: int = Field(1, ge=1)
    samples_every: int = Field(10, ge=1)  # write rollout samples every N steps
    samples_per_step: int = Field(4, ge=0)


class RunConfig(Strict):
    """The run directory runs/<name>-<timestamp>/."""

    name: str = "run"
    root: str = "runs"
    save_model: bool = True


class EvalConfig(Strict):
    """Held-out evaluation during and after training."""

    every: int = Field(0, ge=0)  # 0: only before and after training
    n: int = Field(500, ge=0)  # held-out problems (<= task.n_heldout); 0: no evaluation
    batch_size: int = Field(256, ge=1)
    max_new_tokens: int = Field(32, ge=1)
    k: int = Field(0, ge=0)  # pass@k samples per problem; 0 to skip
    temperature: float = Field(1.0, gt=0)


# ---------------------------------------------------------------------------------------------
# SFT
# ---------------------------------------------------------------------------------------------


class SFTDataConfig(Strict):
    """SFT pairs from the task (question -> answer) or from a local JSONL file."""

    source: Literal["task", "jsonl"] = "task"
    path: str | None = None  # jsonl: `messages` or `prompt`/`completion` rows
    on_invalid: Literal["error", "drop"] = "error"

    @model_validator(mode="after")
    def _path_for_jsonl(self) -> SFTDataConfig:
        if self.source == "jsonl" and not self.path:
            raise ValueError("data.path is required when data.source is 'jsonl'")
        return self


class SFTTrainConfig(Strict):
    steps: int = Field(100, ge=1)
    batch_size: int = Field(64, ge=1)  # sequences per optimizer step
    micro_batch_size: int = Field(64, ge=1)
    max_len: int = Field(256, ge=8)
    max_seconds: float | None = Field(None, gt=0)  # stop early at this wall-clock budget


class SFTConfig(Strict):
    trainer: Literal["sft"] = "sft"
    seed: int = 0
    model: ModelConfig
    task: TaskConfig = Field(default_factory=TaskConfig)
    data: SFTDataConfig = Field(default_factory=SFTDataConfig)
    train: SFTTrainConfig = Field(default_factory=SFTTrainConfig)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-3))
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _micro(self) -> SFTConfig:
        _check_micro(self.train.batch_size, self.train.micro_batch_size, "train")
        return self


# ---------------------------------------------------------------------------------------------
# Policy gradients
# ---------------------------------------------------------------------------------------------


class RolloutConfig(Strict):
    """Sampling: all prompts of a step in one batched generation with a KV cache."""

    prompts_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1)
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0: off


class LossConfig(Strict):
    """The named parts of the update: advantage, surrogate and aggregation (see losses/)."""

    advantage: str = "group_zscore"
    advantage_args: dict[str, Any] = Field(default_factory=dict)
    surrogate: str = "ppo_clip"
    surrogate_args: dict[str, Any] = Field(default_factory=dict)
    aggregation: str = "seq_mean_token_mean"

    @model_validator(mode="after")
    def _names_and_args(self) -> LossConfig:
        from rlhflab.losses.advantages import ADVANTAGES
        from rlhflab.losses.aggregate import AGGREGATIONS
        from rlhflab.losses.policy import POLICY_LOSSES

        _check_name("loss.advantage", self.advantage, ADVANTAGES)
        _check_name("loss.surrogate", self.surrogate, POLICY_LOSSES)
        _check_name("loss.aggregation", self.aggregation, AGGREGATIONS)
        _check_kwargs(
            "loss.advantage_args", ADVANTAGES[self.advantage], self.advantage_args, {"group_size"}
        )
        _check_kwargs(
            "loss.surrogate_args", POLICY_LOSSES[self.surrogate], self.surrogate_args, set()
        )
        return self


class KLConfig(Strict):
    """KL(π_θ ‖ π_ref) regularisation. A reference model is loaded only when coef > 0."""

    coef: float = Field(0.0, ge=0)
    estimator: str = "k3"
    placement: Literal["loss"] = "loss"

    @model_validator(mode="after")
    def _estimator(self) -> KLConfig:
        from rlhflab.losses.kl import KL_ESTIMATORS

        _check_name("kl.estimator", self.estimator, KL_ESTIMATORS)
        return self


class PGTrainConfig(Strict):
    steps: int = Field(100, ge=1)
    micro_batch_size: int = Field(64, ge=1)  # completions per forward/backward
    update_epochs: int = Field(1, ge=1)  # passes over each rollout batch
    minibatches: int = Field(1, ge=1)  # optimizer steps per epoch
    max_seconds: float | None = Field(None, gt=0)


class PGConfig(Strict):
    trainer: Literal["policy_gradient"] = "policy_gradient"
    seed: int = 0
    model: ModelConfig
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    train: PGTrainConfig = Field(default_factory=PGTrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _consistency(self) -> PGConfig:
        group_advantages = {"group_zscore", "group_mean", "rloo"}
        if self.loss.advantage in group_advantages and self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size must be >= 2 for the group advantage "
                f"'{self.loss.advantage}' (got {self.rollout.group_size})"
            )
        if self.loss.advantage == "gae":
            raise ValueError(
                "loss.advantage 'gae' needs a value model (PPO), which this trainer does not have yet"
            )
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        if batch % self.train.minibatches:
            raise ValueError(
                f"train.minibatches ({self.train.minibatches}) must divide the rollout batch "
                f"(rollout.prompts_per_step × rollout.group_size = {batch})"
            )
        return self


CONFIG_CLASSES: dict[str, type[Strict]] = {"sft": SFTConfig, "policy_gradient": PGConfig}
AnyConfig = Union[SFTConfig, PGConfig]  # noqa: UP007


# ---------------------------------------------------------------------------------------------
# Checks used by the validators
# ---------------------------------------------------------------------------------------------


def _check_micro(batch: int, micro: int, section: str) -> None:
    if micro > batch or batch % micro:
        raise ValueError(
            f"{section}.micro_batch_size ({micro}) must divide {section}.batch_size ({batch})"
        )


def _did_you_mean(name: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_name(field: str, name: str, registry: dict) -> None:
    if name not in registry:
        raise ValueError(
            f"{field}: unknown name '{name}'{_did_you_mean(name, registry)}; "
            f"valid: {', '.join(sorted(registry))}"
        )


def _check_kwargs(field: str, fn: typing.Callable, kwargs: dict, supplied: set[str]) -> None:
    """Check `kwargs` against the keyword-only parameters of `fn` (minus those the trainer supplies)."""
    params = inspect.signature(fn).parameters
    valid = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} - supplied
    for key in kwargs:
        if key not in valid:
            choices = ", ".join(sorted(valid)) or "none"
            raise ValueError(
                f"{field}.{key}: not an argument of {fn.__name__}{_did_you_mean(key, valid)}; "
                f"valid: {choices}"
            )


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _section_class(cls: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """The config class found by following `path` through nested fields of `cls`."""
    for key in path:
        if not isinstance(key, str) or key not in cls.model_fields:
            return None
        annotation = cls.model_fields[key].annotation
        candidates = [annotation]
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is Union:
            candidates = list(typing.get_args(annotation))
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        cls = nested[0]
    return cls


def _format_error(cls: type[BaseModel], err: ValidationError) -> str:
    first = err.errors()[0]
    loc = tuple(first["loc"])
    dotted = ".".join(str(p) for p in loc)
    if first["type"] == "extra_forbidden":
        parent = _section_class(cls, loc[:-1])
        hint = _did_you_mean(str(loc[-1]), parent.model_fields) if parent else ""
        return f"unknown config key '{dotted}'{hint}"
    if first["type"] == "missing":
        return f"missing config key '{dotted}'"
    msg = first["msg"].removeprefix("Value error, ")
    if not dotted:
        return msg
    return f"{dotted}: {msg} (got {first.get('input')!r})"


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides to a nested dict; values are parsed as YAML scalars."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key.path=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = raw
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{key}': '{part}' is not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ConfigError(f"override '{key}': cannot parse value {value!r}: {exc}") from None
    return raw


def config_from_dict(raw: dict, *, source: str = "config") -> AnyConfig:
    """Validate a raw dict into the config class named by its `trainer` key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    trainer = raw.get("trainer")
    if trainer not in CONFIG_CLASSES:
        raise ConfigError(
            f"{source}: 'trainer' must be one of {', '.join(CONFIG_CLASSES)} "
            f"(got {trainer!r}){_did_you_mean(str(trainer), CONFIG_CLASSES)}"
        )
    cls = CONFIG_CLASSES[trainer]
    try:
        return cls.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{source}: {_format_error(cls, err)}") from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> AnyConfig:
    """Read a YAML preset, apply dotted overrides, validate. Errors are one-line ConfigErrors."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {str(exc).splitlines()[0]}") from None
    raw = apply_overrides(raw, overrides or [])
    return config_from_dict(raw, source=str(path))


def dump_config(cfg: BaseModel) -> str:
    """The resolved config as YAML (every default written out)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)

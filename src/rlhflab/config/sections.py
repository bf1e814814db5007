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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlhflab.errors import ConfigError


class Strict(BaseModel):
    """Base for every config section: unknown keys are errors; true/false is not a number."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info) -> Any:
        # pydantic's lax mode reads true as 1 for int and float fields (`train.steps=true`).
        if isinstance(value, bool) and _wants_number(cls.model_fields[info.field_name].annotation):
            raise ValueError("must be a number, not true/false")
        return value


def _wants_number(annotation: Any) -> bool:
    """An int or float annotation (possibly inside Optional / a union) that does not accept bool."""
    args = set(typing.get_args(annotation)) or {annotation}
    if typing.get_origin(annotation) is typing.Annotated:
        return _wants_number(typing.get_args(annotation)[0])
    return bool(args & {int, float}) and bool not in args


#: Seeds feed torch.manual_seed (< 2**64) and derived streams (seed + 1): kept below 2**63.
SEED_MAX = 2**63 - 1


# ---------------------------------------------------------------------------------------------
# Shared sections
# ---------------------------------------------------------------------------------------------


class BuildConfig(Strict):
    """Build a small model from scratch with a tokenizer trained on the task text."""

    size: str = "base"  # a key of rlhflab.models.build.SIZE_PRESETS
    arch: Literal["qwen3", "llama", "gpt"] = "qwen3"  # gpt: rlhflab.models.gpt (from scratch)
    vocab_size: int = Field(1024, ge=263)  # byte-level BPE: 256 bytes + 7 special tokens
    max_position_embeddings: int = Field(512, ge=16)
    tokenizer_texts: int = Field(20000, ge=100)  # task strings to train the tokenizer on


class LoRAConfig(Strict):
    """`model.lora`: train low-rank adapters instead of the full weights (peft's `LoraConfig`;
    Hu et al. 2021, arXiv 2106.09685): W x + (alpha / r) · B A x, with A (r, in) and B (out, r),
    B = 0 at the start. The base weights stay frozen; the reference policy is the base with the
    adapters disabled (no second copy); checkpoints hold the adapters only. Glue in
    `rlhflab.models.lora`."""

    r: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    # module names (suffixes) that get adapters; "all-linear": every nn.Linear in the transformer
    # blocks (not the LM head, nor a reward or value head)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    # final `<run>/model`: "merged" (a plain HF model: rlhflab eval, from_pretrained) or
    # "adapter" (adapter_config.json + adapter_model.safetensors for PeftModel.from_pretrained)
    save: Literal["merged", "adapter"] = "merged"

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("name at least one module (or 'all-linear')")
        return value


class ModelConfig(Strict):
    """Which causal LM to train: a hub id / local path, or a model built from scratch."""

    name_or_path: str | None = None
    build: BuildConfig | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: str | None = None  # None: flash_attention_2 if installed on GPU, else sdpa
    trust_remote_code: bool = False
    gguf_file: str | None = None
    # Recompute each layer's activations in the backward pass instead of keeping them: peak
    # memory of a training step drops to the layer inputs (0.38x a naive step with a 49k
    # vocabulary in bench/RESULTS.md) for about one extra forward of compute.
    gradient_checkpointing: bool = False
    lora: LoRAConfig | None = None  # None: full fine-tuning

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
    seed: int = Field(0, ge=0, le=SEED_MAX)
    # how the answer is read from a completion (rlhflab.rewards.verifier.extract_answer):
    # the whole text, the last <answer>..</answer>, the last number, the last line, the last \boxed{}
    answer_format: Literal["tags", "plain", "last_number", "last_line", "boxed"] = "plain"
    extractor: str | None = None  # "module:function" (text -> answer or None); overrides the above
    reward: Literal["binary", "partial"] = "binary"
    system: str | None = None
    # the answer-format instruction after the question (rlhflab.data.formatting
    # .answer_instruction): "auto" (the answer_format's sentence; none for plain or an
    # extractor), "none", or any other text used verbatim
    instruction: str = "auto"

    @field_validator("instruction")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("empty; use 'none' for no instruction")
        return value

    @field_validator("extractor")
    @classmethod
    def _loadable(cls, spec: str | None) -> str | None:
        if spec is not None:
            from rlhflab.rewards.verifier import load_extractor

            try:
                load_extractor(spec)
            except ConfigError as exc:
                raise ValueError(str(exc).removeprefix("task.extractor: ")) from None
        return spec


class PromptDataConfig(Strict):
    """Where on-policy prompts come from (see rlhflab.data.prompts).

    source "task": the `task` section's reasoning_gym task (its verifier is `correctness`).
    source "dataset": `path`, a Hub id (`datasets.load_dataset(path, name, split=split)`) or a local
    .json/.jsonl/.parquet file in TRL's prompt-only formats; `prompt_column` names the prompt
    (GSM8K `question`, MATH `problem`); `prompt_format: hh_transcript` reads an HH-RLHF transcript
    column (`chosen`) and keeps the turns before the last assistant turn. Held out: `heldout_split`
    (a named split), `heldout_path` (a local file), or else a seeded `heldout_frac` of the rows;
    held-out prompts equal to training prompts are dropped and counted.
    """

    source: Literal["task", "dataset"] = "task"
    path: str | None = None
    name: str | None = None  # the Hub dataset's config name (GSM8K: main)
    split: str = "train"
    prompt_column: str = "prompt"
    prompt_format: Literal["auto", "hh_transcript"] = "auto"
    system: str | None = None  # system turn for prompts that have none
    # A plain-text prompt template with "{prompt}" (no chat template is applied): R1-Zero's /
    # TinyZero's prompt for base models. Applies to task and dataset prompts alike.
    template: str | None = None
    heldout_split: str | None = None
    heldout_path: str | None = None
    heldout_frac: float = Field(0.1, ge=0, lt=1)
    n_heldout: int | None = Field(None, ge=1)  # cap on held-out prompts (after dedup)
    max_rows: int | None = Field(None, ge=1)  # cap on training prompts
    seed: int | None = None  # held-out fraction's shuffle; None: the run's seed
    on_invalid: Literal["error", "drop"] = "error"

    @model_validator(mode="after")
    def _path_for_dataset(self) -> PromptDataConfig:
        if self.source == "dataset" and not self.path:
            raise ValueError("data.path is required when data.source is 'dataset'")
        if self.source == "task" and (self.path or self.heldout_path):
            raise ValueError(
                "data.path is set but data.source is 'task' (prompts from the task); "
                "set data.source=dataset to train on the file's prompts"
            )
        if self.template is not None and "{prompt}" not in self.template:
            raise ValueError("data.template must contain '{prompt}'")
        if self.heldout_split and self.heldout_path:
            raise ValueError("set at most one of data.heldout_split and data.heldout_path")
        return self


class OptimConfig(Strict):
    """AdamW with linear warmup then a schedule; gradients clipped by global norm.

    Checked here, not by torch at optimizer build: lr, eps > 0 and finite; weight_decay >= 0 and
    finite; each of betas in [0, 1) (beta2 = 1 would divide by zero in Adam's bias correction).
    """

    lr: float = Field(1e-5, gt=0, allow_inf_nan=False)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0, allow_inf_nan=False)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float | None = Field(1.0, gt=0, allow_inf_nan=False)

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, betas: tuple[float, float]) -> tuple[float, float]:
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:  # also false for NaN
                raise ValueError(f"beta{i + 1} = {beta!r} is outside [0, 1)")
        return betas


class PrecisionConfig(Strict):
    """fp32 master weights; optional bf16 autocast for the forward passes."""

    autocast: Literal["auto", "bf16", "none"] = (
        "auto"  # auto: bf16 on CUDA GPUs that have it; CPU: none
    )
    threads: int | None = Field(None, ge=1)  # torch.set_num_threads; None: torch's default


class WandbConfig(Strict):
    """Weights & Biases run options (`tracking.wandb: {project: ..., tags: [...]}`; `true` takes
    every default). An unset option is not passed to `wandb.init`, so wandb's own variables
    apply: WANDB_PROJECT, WANDB_ENTITY, WANDB_RUN_GROUP, WANDB_TAGS, WANDB_NAME, WANDB_MODE..."""

    project: str | None = None  # unset: $WANDB_PROJECT, else "rlhflab"
    entity: str | None = None  # unset: $WANDB_ENTITY, else your default entity
    group: str | None = None  # unset: $WANDB_RUN_GROUP
    tags: list[str] | None = None  # unset: $WANDB_TAGS
    name: str | None = None  # unset: $WANDB_NAME, else the run directory's name


class TrackioConfig(Strict):
    """trackio (local-first, wandb's API) run options; `true` takes every default."""

    project: str | None = None  # unset: "rlhflab"
    name: str | None = None  # unset: the run directory's name
    group: str | None = None
    space_id: str | None = None  # a Hugging Face Space to sync to (unset: local only)


class TrackingConfig(Strict):
    """Where metrics go. The jsonl file is always written."""

    console: bool = True
    wandb: WandbConfig | None = None  # true (every default), the run's options, or false/None
    trackio: TrackioConfig | None = None  # true (every default), the run's options, or false/None
    tensorboard: bool = False
    log_every: int = Field(1, ge=1)
    samples_every: int = Field(10, ge=1)  # write rollout samples every N steps
    samples_per_step: int = Field(4, ge=0)

    @field_validator("wandb", "trackio", mode="before")
    @classmethod
    def _flag_or_options(cls, value: Any) -> Any:
        # `wandb: true` is every default; `false` is off (None)
        if value is True:
            return {}
        return None if value is False else value


class RunConfig(Strict):
    """The run directory runs/<name>-<timestamp>/, and resuming one."""

    name: str = "run"
    root: str = "runs"
    save_model: bool = True
    # None: a fresh run. "auto": continue the newest committed checkpoint of a run of this name
    # under `root` (fresh when there is none). A path: that run directory's newest committed
    # checkpoint, or that checkpoint directory (an error when it holds none).
    resume: str | None = None  # also "latest": like "auto" but an error when there is none
    allow_config_change: bool = False  # resume although keys that matter changed (listed)

    @field_validator("name")
    @classmethod
    def _simple_name(cls, name: str) -> str:
        from rlhflab.runs import check_run_name

        check_run_name(name)
        return name

    @field_validator("root")
    @classmethod
    def _root_is_a_directory(cls, root: str) -> str:
        if Path(root).exists() and not Path(root).is_dir():
            raise ValueError(f"{root} exists and is not a directory")
        return root


class CheckpointConfig(Strict):
    """Atomic, verified checkpoints for exact resume (see rlhflab/checkpoint.py)."""

    # optimizer steps between checkpoints (and one at the end); 0: none, except when a stop
    # signal or a health stop ends the run (a real model's checkpoint with AdamW state is ~12
    # bytes per parameter: 1.6 GB for 135 M parameters)
    every: int = Field(50, ge=0)
    keep_last: int | None = Field(2, ge=1)  # committed checkpoints kept; None keeps all


#: `train.max_seconds` (every trainer; `rlhflab.trainers.common.TimeBudget`).
MAX_SECONDS_DOC = (
    "Wall-clock budget in seconds **per invocation**: each `rlhflab train` (a fresh run or a "
    "`--resume`) gets the whole budget, counted from its own start (set-up and model loading "
    "included); earlier invocations of the run do not count. Checked after each optimizer step "
    "(its evaluation and checkpoint included), so every invocation makes at least one step. When "
    "it has run out before the last step, the run stops after that step with a checkpoint (even "
    "with checkpoint.every: 0), final_results.json says status: stopped_by_max_seconds, and "
    "`--resume` continues with a fresh budget. Run out during the last step, its evaluation or "
    "its checkpoint, the run is complete (status: complete); a `--resume` of a complete run "
    "does nothing and says so. None: no budget."
)


class TrainBase(Strict):
    """Fault policy shared by every trainer's `train` section."""

    # A non-finite loss or gradient norm: "raise" stops before the optimizer step, naming the
    # step and the metric; "skip" drops the step (no optimizer or scheduler step), counts it in
    # train/nan_skips, and raises after `nan_max_skips` skipped steps in a row.
    nan_policy: Literal["raise", "skip"] = "raise"
    nan_max_skips: int = Field(3, ge=1)


class EvalConfig(Strict):
    """Held-out evaluation during and after training."""

    every: int = Field(0, ge=0)  # 0: only before and after training
    n: int = Field(500, ge=0)  # held-out problems (<= task.n_heldout); 0: no evaluation
    batch_size: int = Field(256, ge=1)
    max_new_tokens: int = Field(32, ge=1)
    k: int = Field(0, ge=0)  # pass@k samples per problem; 0 to skip
    temperature: float = Field(1.0, gt=0)


class ParallelConfig(Strict):
    """Data parallelism under torchrun (see rlhflab/distributed.py and README "Many GPUs").

    With one process every strategy is the plain single-process run.
    """

    # auto: "ddp" when launched with several processes, else "none". ddp: replicas, gradients
    # summed once per optimizer step. fsdp2: parameters, gradients and optimizer state sharded
    # per decoder layer (torch.distributed.fsdp.fully_shard).
    strategy: Literal["auto", "none", "ddp", "fsdp2"] = "auto"
    mixed_precision: Literal["fp32", "bf16"] = "fp32"  # fsdp2: parameter dtype for compute
    cpu_offload: bool = False  # fsdp2: parameters, gradients and optimizer state on CPU
    timeout_s: float = Field(600.0, gt=0)  # a collective waiting longer fails the job


class HealthConfig(Strict):
    """`health`: live checks of the run (rlhflab.health; meanings and thresholds in docs/health.md).

    on_fail: "warn" prints one line the first time a check fails and counts later failures;
    "stop" also ends the run after that step with a committed checkpoint and exit code 3.
    Sustained checks fail after `patience` steps in a row; trend checks look at `window` steps.
    """

    enabled: bool = True
    on_fail: Literal["warn", "stop"] = "warn"
    skip: list[str] = Field(default_factory=list)  # check names to leave out
    patience: int = Field(3, ge=1)
    window: int = Field(20, ge=2)
    sample_every: int = Field(10, ge=0)  # sampled softmax-sum check every N steps; 0: never
    prob_sum_tol: float = Field(1e-3, gt=0)
    logp_tol: float = Field(1e-4, ge=0)
    logp_mismatch_max: float = Field(0.05, gt=0)  # mean |sampler logp - trainer logp| per token
    ratio_tol: float = Field(1e-3, gt=0)
    grad_norm_min: float = Field(1e-8, ge=0)
    grad_norm_max: float = Field(1e4, gt=0)
    param_change_min: float = Field(1e-10, ge=0)  # relative parameter change per step
    loss_change_min: float = Field(1e-6, ge=0)
    reward_change_min: float = Field(1e-6, ge=0)
    entropy_min: float = Field(1e-3, ge=0)  # nats per token
    entropy_max_frac: float = Field(0.95, gt=0)  # of ln(vocab size)
    kl_max: float = Field(1.0, gt=0)  # nats per token
    clip_frac_max: float = Field(0.3, gt=0)
    truncation_max: float = Field(0.5, ge=0, le=1)
    empty_max: float = Field(0.5, ge=0, le=1)
    repeat_max: float = Field(0.5, ge=0, le=1)
    identical_max: float = Field(0.5, ge=0, le=1)
    nonprintable_max: float = Field(0.5, ge=0, le=1)
    hacking_drop: float = Field(0.05, ge=0)  # held-out accuracy drop (and reward rise) that counts

    @field_validator("skip")
    @classmethod
    def _known_checks(cls, names: list[str]) -> list[str]:
        from rlhflab.health import CHECK_NAMES

        for name in names:
            if name not in CHECK_NAMES:
                close = difflib.get_close_matches(name, CHECK_NAMES, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ValueError(f"unknown health check '{name}'{hint}")
        return names


class TrainerConfig(Strict):
    """Sections every trainer family shares; the family's own sections follow them."""

    trainer: str
    seed: int = Field(0, ge=0, le=SEED_MAX)
    model: ModelConfig  # RM: the backbone (a causal LM, usually the SFT policy) or a saved RM
    task: TaskConfig = Field(default_factory=TaskConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)


# ---------------------------------------------------------------------------------------------
# SFT
# ---------------------------------------------------------------------------------------------


class SFTDataConfig(Strict):
    """SFT examples from the task (question -> answer) or from a dataset.

    source "dataset" (alias "jsonl"): `path` is a local .jsonl/.json/.parquet/.csv file, a local
    dataset directory or a Hub id (`split`), with `text`, `messages` or `prompt`/`completion` rows
    (rlhflab.data.sft). `assistant_turns`: which assistant turns of `messages` rows are trained,
    "all" (TRL's assistant_only_loss) or "last".
    """

    source: Literal["task", "dataset", "jsonl"] = "task"
    path: str | None = None
    split: str = "train"  # of a dataset directory or Hub id
    assistant_turns: Literal["all", "last"] = "all"
    on_invalid: Literal["error", "drop"] = "error"

    @model_validator(mode="after")
    def _path_for_jsonl(self) -> SFTDataConfig:
        if self.source != "task" and not self.path:
            raise ValueError(f"data.path is required when data.source is '{self.source}'")
        return self


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


# ---------------------------------------------------------------------------------------------
# Policy gradients
# ---------------------------------------------------------------------------------------------


class DynamicSamplingConfig(Strict):
    """DAPO's dynamic sampling: draw further prompt batches until every group of the step has
    non-zero reward variance (groups with all-equal rewards carry no gradient and are dropped)."""

    enabled: bool = False
    max_rounds: int = Field(8, ge=1)  # generation rounds per step; then a DataError


class VLLMConfig(Strict):
    """The colocated `vllm` rollout engine (vLLM's offline LLM in the trainer's process)."""

    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)  # share of GPU memory vLLM may take
    enable_prefix_caching: bool = True  # a group's prompt is prefilled once
    max_model_len: int | None = Field(None, ge=1)  # default: the model's context length
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    cpu_kvcache_space_gb: int = Field(1, ge=1)  # CPU build only: its KV-cache size (GiB)
    # Colocated mode: between rollouts vLLM offloads its weights to CPU memory and frees its KV
    # cache (vLLM sleep mode, level 1), so the trainer's update has the GPU. CUDA/ROCm only.
    sleep: bool = False
    # vLLM's tensor parallelism for a model too large for one GPU: the LLM shards the model over
    # this many GPUs (vLLM starts one worker process per GPU). Untested here (no GPU).
    tensor_parallel_size: int = Field(1, ge=1)


class RolloutConfig(Strict):
    """Sampling: all prompts of a step in one batched generation, through `engine`
    (rlhflab.rollout.engines: "hf", our KV-cache sampler; "vllm", colocated vLLM)."""

    prompts_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1)
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0: off
    min_p: float = Field(0.0, ge=0, lt=1)  # 0: off
    stop_token_ids: list[int] = Field(default_factory=list)  # besides EOS and the model's own
    engine: Literal["hf", "vllm"] = "hf"
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)


class RewardComponentConfig(Strict):
    """One reward term: weight · component, logged as rollout/reward/<name>_mean.

    `name` is a named component (REWARD_COMPONENTS: correctness, format, length, overlong,
    reward_model) or a built-in reward function (REWARD_FUNCTIONS: math_verify, exact_match,
    think_format); or set `function` to a TRL-convention reward function by import path
    ("pkg.module:fn" or "path/to/file.py:fn"), then `name` is its label (default: the function's
    name). `args` are keyword arguments (checked against named components' signatures).
    """

    name: str | None = None
    function: str | None = None
    label: str | None = None  # the logged name when `name` repeats (two reward models)
    weight: float = 1.0
    args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _name_and_args(self) -> RewardComponentConfig:
        from rlhflab.rewards.functions import REWARD_FUNCTIONS, load_reward_function
        from rlhflab.rewards.shaping import REWARD_COMPONENTS, SUPPLIED_ARGS

        if self.function is not None:
            try:
                load_reward_function(self.function)
            except ConfigError as exc:
                raise ValueError(f"reward.components.function: {exc}") from None
            if self.name is None:
                self.name = self.function.rsplit(":", 1)[-1]
            return self
        if self.name is None:
            raise ValueError("reward.components: each component needs a name or a function")
        if self.name in REWARD_FUNCTIONS:
            _check_kwargs(
                f"reward.components[{self.name}].args",
                REWARD_FUNCTIONS[self.name],
                self.args,
                set(),
            )
            return self
        _check_name("reward.components.name", self.name, {**REWARD_COMPONENTS, **REWARD_FUNCTIONS})
        _check_kwargs(
            f"reward.components[{self.name}].args",
            REWARD_COMPONENTS[self.name],
            self.args,
            SUPPLIED_ARGS,
        )
        return self


class RewardConfig(Strict):
    """The scalar reward of a completion: the sum of weighted named components (each logged as
    rollout/reward/<name>_mean). `correctness` scores with the task's verifier (task.reward)."""

    components: list[RewardComponentConfig] = Field(
        default_factory=lambda: [RewardComponentConfig(name="correctness")]
    )

    @model_validator(mode="after")
    def _unique(self) -> RewardConfig:
        names = [c.label or c.name for c in self.components]
        if not names:
            raise ValueError("reward.components: at least one component is required")
        if len(set(names)) != len(names):
            raise ValueError(
                f"reward.components: names must be unique (give repeats a `label`), got {names}"
            )
        return self


class TISConfig(Strict):
    """Truncated importance sampling of the policy-gradient term by min(π_θold / π_sampler, cap)
    (rlhflab.losses.correction.truncated_importance_weights; Yao et al. 2025)."""

    enabled: bool = False
    cap: float = Field(2.0, gt=0)  # C; Yao et al. use 2, TRL's default is 3


class LossConfig(Strict):
    """The named parts of the update: advantage, surrogate and aggregation (see losses/)."""

    advantage: str = "group_zscore"
    advantage_args: dict[str, Any] = Field(default_factory=dict)
    whiten_advantages: bool = False  # losses.advantages.whiten over the batch's valid tokens
    surrogate: str = "ppo_clip"
    surrogate_args: dict[str, Any] = Field(default_factory=dict)
    aggregation: str = "seq_mean_token_mean"
    tis: TISConfig = Field(default_factory=TISConfig)  # training–inference mismatch correction

    @model_validator(mode="after")
    def _names_and_args(self) -> LossConfig:
        from rlhflab.losses.advantages import ADVANTAGES
        from rlhflab.losses.aggregate import AGGREGATIONS
        from rlhflab.losses.policy import POLICY_LOSSES

        _check_name("loss.advantage", self.advantage, ADVANTAGES)
        _check_name("loss.surrogate", self.surrogate, POLICY_LOSSES)
        _check_name("loss.aggregation", self.aggregation, AGGREGATIONS)
        _check_kwargs(
            "loss.advantage_args",
            ADVANTAGES[self.advantage],
            self.advantage_args,
            {"group_size"},
            required=True,
        )
        _check_kwargs(
            "loss.surrogate_args", POLICY_LOSSES[self.surrogate], self.surrogate_args, set()
        )
        _check_clip_bounds("loss.surrogate_args", self.surrogate_args)
        return self


class KLConfig(Strict):
    """KL(π_θ ‖ π_ref) regularisation. A reference model is loaded only when coef > 0.

    placement: "loss" adds coef·KL_t to the per-token loss (GRPO); "reward_sequence" subtracts
    coef·Σ_t KL_t from the completion's reward before the advantage (RLOO, REINFORCE);
    "reward_token" gives each token the reward −coef·KL_t, plus the completion's reward at its last
    token (PPO / InstructGPT; needs a per-token advantage such as gae).
    controller: "fixed" keeps coef; "adaptive" is Ziegler et al. 2019's proportional controller
    towards `target` (KL per completion, summed over tokens) with horizon `horizon` completions.
    """

    coef: float = Field(0.0, ge=0)
    estimator: str = "k3"
    placement: Literal["loss", "reward_sequence", "reward_token"] = "loss"
    controller: Literal["fixed", "adaptive"] = "fixed"
    target: float | None = Field(None, gt=0)
    horizon: int = Field(10000, ge=1)

    @model_validator(mode="after")
    def _estimator(self) -> KLConfig:
        from rlhflab.losses.kl import KL_ESTIMATORS

        _check_name("kl.estimator", self.estimator, KL_ESTIMATORS)
        if self.controller == "adaptive" and (self.target is None or self.coef <= 0):
            raise ValueError(
                "kl.controller 'adaptive' needs kl.target and an initial kl.coef > 0 "
                f"(got target={self.target}, coef={self.coef})"
            )
        return self


class ValueConfig(Strict):
    """PPO's critic: the policy's backbone (copied at start, or loaded from `init_from`, e.g. a
    reward model) with a scalar head, trained with its own AdamW on the clipped value loss."""

    init_from: str | None = None  # None: a copy of the initial policy with a fresh head
    clip_range: float = Field(0.2, gt=0)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4))


class PGTrainConfig(TrainBase):
    """Policy-gradient budget: rollout steps, micro-batch size, update epochs × minibatches."""

    steps: int = Field(100, ge=1)
    micro_batch_size: int = Field(64, ge=1)  # completions per forward/backward
    update_epochs: int = Field(1, ge=1)  # passes over each rollout batch
    minibatches: int = Field(1, ge=1)  # optimizer steps per epoch
    max_seconds: float | None = Field(None, gt=0, description=MAX_SECONDS_DOC)


class PGConfig(TrainerConfig):
    """Config of `trainer: policy_gradient` (see trainers/policy_gradient.py)."""

    trainer: Literal["policy_gradient"] = "policy_gradient"
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    value: ValueConfig | None = None  # set for advantages that need a critic (gae)
    data: PromptDataConfig = Field(default_factory=PromptDataConfig)
    train: PGTrainConfig = Field(default_factory=PGTrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _consistency(self) -> PGConfig:
        from rlhflab.losses.advantages import ADVANTAGES

        params = inspect.signature(ADVANTAGES[self.loss.advantage]).parameters
        per_group, per_token = "group_size" in params, "values" in params
        if per_group and self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size must be >= 2 for the group advantage "
                f"'{self.loss.advantage}' (got {self.rollout.group_size})"
            )
        if self.rollout.dynamic_sampling.enabled and self.rollout.group_size < 2:
            raise ValueError(
                "rollout.group_size must be >= 2 for rollout.dynamic_sampling "
                f"(got {self.rollout.group_size})"
            )
        if per_token and self.value is None:
            raise ValueError(
                f"value: loss.advantage '{self.loss.advantage}' needs a value model; "
                "add a `value:` section"
            )
        if self.value is not None and not per_token:
            raise ValueError(
                f"value: a value model is set but loss.advantage '{self.loss.advantage}' "
                "does not use one (use 'gae' or remove the `value:` section)"
            )
        if self.kl.placement == "reward_token" and not per_token:
            raise ValueError(
                f"kl.placement 'reward_token' needs a per-token advantage such as 'gae' "
                f"(loss.advantage is '{self.loss.advantage}'; use 'reward_sequence')"
            )
        for comp in self.reward.components:
            if comp.name == "overlong":  # DAPO's L_cache must fit in L_max
                cache, limit = comp.args.get("cache"), comp.args.get("max_len")
                limit = limit or self.rollout.max_new_tokens
                if not isinstance(cache, int) or isinstance(cache, bool) or not 0 < cache <= limit:
                    raise ValueError(
                        f"reward.components[overlong].args.cache must be an integer in "
                        f"1..{limit} (args.max_len or rollout.max_new_tokens), got {cache!r}"
                    )
        if self.data.source == "dataset" and any(
            c.name == "correctness" and c.function is None for c in self.reward.components
        ):
            raise ValueError(
                "reward.components: 'correctness' scores with the task's verifier; with "
                "data.source 'dataset' use math_verify, exact_match or a reward function"
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


def _check_kwargs(
    field: str, fn: typing.Callable, kwargs: dict, supplied: set[str], *, required: bool = False
) -> None:
    """Check `kwargs` against the keyword-only parameters of `fn` (minus those the trainer supplies).

    With required=True, keyword-only parameters without a default must be present too.
    """
    params = inspect.signature(fn).parameters
    valid = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} - supplied
    for key in kwargs:
        if key not in valid:
            choices = ", ".join(sorted(valid)) or "none"
            raise ValueError(
                f"{field}.{key}: not an argument of {fn.__name__}{_did_you_mean(key, valid)}; "
                f"valid: {choices}"
            )
    if required:
        missing = [n for n in sorted(valid) if params[n].default is inspect.Parameter.empty]
        missing = [n for n in missing if n not in kwargs]
        if missing:
            raise ValueError(f"{field}: {fn.__name__} needs {', '.join(missing)}")


def _check_clip_bounds(field: str, args: dict) -> None:
    """Clip bounds [1 − eps_low, 1 + eps_high] must satisfy 0 <= 1 − eps_low <= 1 <= 1 + eps_high."""
    eps_low, eps_high = args.get("eps_low", 0.0), args.get("eps_high", 0.0)
    for name, eps in (("eps_low", eps_low), ("eps_high", eps_high)):
        if eps is not None and not isinstance(eps, int | float):
            raise ValueError(f"{field}.{name}: must be a number, got {eps!r}")
    low = 1.0 - (eps_low or 0.0)
    high = 1.0 + eps_high
    if not 0.0 <= low <= 1.0 <= high or eps_low == 1.0:
        raise ValueError(
            f"{field}: clip bounds out of order: need 0 <= 1 - eps_low < 1 <= 1 + eps_high, "
            f"got eps_low={eps_low}, eps_high={eps_high} (bounds [{low:g}, {high:g}])"
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


def config_has_key(cls: type[BaseModel], dotted: str) -> bool:
    """Whether the config class `cls` has the key `dotted` (`rollout.group_size`): every part
    names a field of the section before it; below a free-form dict field (`task.config`,
    `loss.surrogate_args`) any key counts, as the dict's own checks decide later."""
    parts = dotted.strip().split(".")
    for i, key in enumerate(parts):
        if key not in cls.model_fields:
            return False
        annotation = cls.model_fields[key].annotation
        candidates = [annotation]
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is Union:
            candidates = list(typing.get_args(annotation))
        if i == len(parts) - 1:
            return True
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if nested:
            cls = nested[0]
            continue
        return any(c is dict or typing.get_origin(c) is dict for c in candidates)
    return True


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


def override_value(key: str, value: str) -> Any:
    """The value of the override `key=value`, from its text.

    Parsed as YAML (numbers, booleans, null, quoted strings, and flow-style `{a: 1}` / `[1, 2]`),
    except that the text itself is the value when YAML fails to parse it (`Q: {prompt} A:`),
    when YAML reads a mapping or sequence from text that is not one `{...}` / `[...]` (`Q: x`,
    `- a`, `{prompt} #1`: write `{Q: x}` or `[a]` for those), when YAML reads a mapping without
    any `:` (`{prompt}`: a template placeholder), or when YAML reads an unquoted string from it
    (so `a #b` keeps ` #b`, which YAML would drop as a comment). Raises ConfigError naming `key`
    when `value` is empty (`key=`: write `key=null` or `key=''`).
    """
    if not value.strip():
        raise ConfigError(
            f"override '{key}=' has no value (write {key}=null for none, {key}='' for empty text)"
        )
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    text = value.strip()
    if isinstance(parsed, (dict, list)) and text[0] + text[-1] not in ("{}", "[]"):
        return value  # `Q: x`, `- a`, `{prompt} #1`: text
    if isinstance(parsed, dict) and parsed and ":" not in text:
        return value  # `{prompt}`: a placeholder, not a mapping of nulls
    if isinstance(parsed, str) and not text.startswith(("'", '"')):
        return value
    return parsed


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides to a nested dict; values are read by `override_value`."""
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
        node[parts[-1]] = override_value(key.strip(), value)
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


def read_yaml(path: str | Path) -> Any:
    """The YAML document in the file `path` (None for an empty file).

    Raises ConfigError, one line, on a syntax error:
    `FILE: invalid YAML at line L, column C: <problem> (<context> started at line L', column C')`,
    lines and columns 1-based (PyYAML's marks of the problem and of what it was parsing).
    """
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        context, opened = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and opened is not None and opened is not mark:
            context += f" started at line {opened.line + 1}, column {opened.column + 1}"
        detail = " ".join((f"{problem} ({context})" if context else problem).split())
        raise ConfigError(f"{path}: invalid YAML{where}: {detail}") from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> AnyConfig:
    """Read a YAML preset, apply dotted overrides, validate. Errors are one-line ConfigErrors."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    raw = read_yaml(path) or {}
    raw = apply_overrides(raw, overrides or [])
    return config_from_dict(raw, source=str(path))


def dump_config(cfg: BaseModel) -> str:
    """The resolved config as YAML (every default written out)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


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


class DPOLossConfig(Strict):
    """`name` is a key of rlhflab.losses.preference.PREFERENCE_LOSSES; `args` its keyword args."""

    name: str = "dpo"
    args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _name_and_args(self) -> DPOLossConfig:
        from rlhflab.losses.preference import PREFERENCE_LOSSES

        _check_name("loss.name", self.name, PREFERENCE_LOSSES)
        _check_kwargs(
            "loss.args",
            PREFERENCE_LOSSES[self.name],
            self.args,
            {"chosen_lengths", "rejected_lengths"},
        )
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
        if (
            self.data.format == "unpaired"
            and self.data.source == "file"
            and self.loss.name != "kto"
        ):
            raise ValueError(
                f"data.format 'unpaired' (prompt/completion/label rows) needs loss.name 'kto', "
                f"not '{self.loss.name}'"
            )
        return self


CONFIG_CLASSES["direct_alignment"] = DPOConfig
AnyConfig = Union[AnyConfig, DPOConfig]  # noqa: UP007


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
    """

    source: Literal["task_samples", "worked_solutions", "preference", "prm800k"] = "task_samples"
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
        if src in ("preference", "prm800k") and not self.data.path:
            raise ValueError(f"data.path is required when data.source is {src!r}")
        if src == "task_samples" and not (self.data.policy or self.model.name_or_path):
            raise ValueError("data.policy (or model.name_or_path) is needed to sample task data")
        if self.model.lora is not None and self.model.lora.save == "adapter":
            raise ValueError(
                "model.lora.save: a reward model is saved merged (its score head is "
                "trained in full), not as an adapter directory"
            )
        return self


CONFIG_CLASSES["reward_model"] = RMConfig
AnyConfig = Union[AnyConfig, RMConfig]  # noqa: UP007

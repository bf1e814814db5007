"""Config sections that every trainer family shares, and `TrainerConfig`, the families' base.

Also the sections two families share: `PromptDataConfig` (policy gradients, and the prompts of
direct alignment's sampled pairs) and `RewardComponentConfig` (the policy-gradient reward, and
the labels of direct alignment's verifiable pairs).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from rlhflab.config.base import SEED_MAX, Strict, _check_kwargs, _check_name
from rlhflab.errors import ConfigError

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
    # Parameter dtype of a loaded model (its AdamW state follows). "float64" is for exactness
    # checks (tests/distributed: N ranks x micro-batches = one process), where float32 sums
    # legitimately differ with the CPU kernels torch picks (AVX-512 / AVX2 / scalar).
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
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


class OptimConfig(Strict):
    """AdamW with linear warmup then a schedule; gradients clipped by global norm.

    `name` picks how AdamW keeps its state (`rlhflab.optimizers`): "adamw" (torch; m and v in
    the parameters' dtype), "adamw_8bit" (torchao; m and v block-wise 8-bit, 2.03 bytes per
    parameter), "adamw_bf16" (torchao; bfloat16 weights, m and v with stochastic rounding;
    needs model.dtype: bfloat16). The last two need `pip install "rlhflab[lowmem]"`.

    Checked here, not by torch at optimizer build: lr, eps > 0 and finite; weight_decay >= 0 and
    finite; each of betas in [0, 1) (beta2 = 1 would divide by zero in Adam's bias correction).
    """

    name: Literal["adamw", "adamw_8bit", "adamw_bf16"] = "adamw"
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


#: `train.max_seconds` (every trainer; `rlhflab.trainers.loop.TimeBudget`).
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
    """Shared by every trainer's `train` section: the fault policy and the token budget of a
    micro-batch."""

    # Token budget of one forward/backward (the knob of verl's ppo_max_token_len_per_gpu under
    # use_dynamic_bsz; the split differs: distributed.token_budget_split):
    # when set, each rank's rows of an optimizer step (and of the no-gradient reference, old
    # log-prob and value passes) are grouped by length, longest first, into micro-batches whose
    # padded grid (sequences × (longest prompt + longest completion)) holds at most this many
    # tokens; it replaces `micro_batch_size`. Denominators stay those of the whole step, so the
    # update equals fixed micro-batches' up to float rounding. A row longer than the budget is a
    # micro-batch alone (logged). None: `micro_batch_size` rows per micro-batch.
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)

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
    # pass@k: an int k draws k samples per problem (pass@1, pass@k; 0 skips sampling); a list
    # [1, 4, 16] reports pass@k and maj@k at each k from n_samples samples per problem
    # (rlhflab.eval.passk; eval/pass@<k>, eval/maj@<k> with standard errors over problems).
    k: int | list[int] = 0
    n_samples: int = Field(0, ge=0)  # samples per problem for a list k; 0: max(k)
    temperature: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _check_k(self) -> EvalConfig:
        ks = [self.k] if isinstance(self.k, int) else self.k
        if isinstance(self.k, int) and self.k < 0:
            raise ValueError(f"eval.k must be >= 0 (got {self.k})")
        if isinstance(self.k, list) and (not ks or any(x < 1 for x in ks)):
            raise ValueError(f"eval.k: a list needs ks >= 1 (got {self.k})")
        if self.n_samples and ks and self.n_samples < max(ks):
            raise ValueError(f"eval.n_samples {self.n_samples} is below the largest k {max(ks)}")
        return self


class ParallelConfig(Strict):
    """Data parallelism under torchrun (see rlhflab/distributed/ and docs/distributed.md).

    With one process every strategy is the plain single-process run.
    """

    # auto: "ddp" when launched with several processes, else "none". ddp: replicas, gradients
    # summed once per optimizer step. fsdp2: parameters, gradients and optimizer state sharded
    # per decoder layer (torch.distributed.fsdp.fully_shard).
    strategy: Literal["auto", "none", "ddp", "fsdp2"] = "auto"
    mixed_precision: Literal["fp32", "bf16"] = "fp32"  # fsdp2: parameter dtype for compute
    cpu_offload: bool = False  # fsdp2: parameters, gradients and optimizer state on CPU
    timeout_s: float = Field(600.0, gt=0)  # a collective waiting longer fails the job


class PerfConfig(Strict):
    """Per-stage timing and throughput (`rlhflab.throughput`, docs/metrics.md `perf/`)."""

    # one card's dense bf16 peak in TFLOP/s for `perf/mfu_*`; None: the card's entry of the peak
    # table on CUDA (`rlhflab.throughput.PEAK_TFLOPS`), no MFU on CPU or an unknown card
    peak_tflops: float | None = Field(None, gt=0)
    stage_timers: bool = True  # false: no perf/<stage>_s keys (measures the timers' own cost)


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
    # mean |sampler logp - trainer logp| per token (nats); None: by the run's precision,
    # rlhflab.health.checks.LOGP_MISMATCH_MAX (fp32 1e-3, bf16 0.05; docs/health.md)
    logp_mismatch_max: float | None = Field(None, gt=0)
    ratio_tol: float = Field(1e-3, gt=0)
    grad_norm_min: float = Field(1e-8, ge=0)
    grad_norm_max: float = Field(1e4, gt=0)
    param_change_min: float = Field(1e-10, ge=0)  # relative parameter change per step
    loss_change_min: float = Field(1e-6, ge=0)
    reward_change_min: float = Field(1e-6, ge=0)
    entropy_min: float = Field(1e-3, ge=0)  # nats per token
    entropy_max_frac: float = Field(0.95, gt=0)  # of ln(vocab size)
    kl_max: float = Field(1.0, gt=0)  # nats per token
    # distill_kl_flat: mean distill/kl of the last window over that of the first window
    distill_kl_ratio_max: float = Field(0.95, gt=0)
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
    """Sections every trainer family shares; the family's own sections follow them.

    A family with a `rollout` section declares in `ROLLOUT_KEYS` the keys of it that its trainer
    reads (a section's name covers its keys: "vllm", "dynamic_sampling"); every other key must
    keep its default, and a key that only some setting of another key reads
    (`RolloutConfig.ONLY_WITH`) must keep its default under the other settings. A setting that
    would be ignored is refused at load (`_rollout_keys_read`), never dropped silently.
    """

    #: The `rollout` keys this family's trainer reads (dotted; a section covers its keys).
    ROLLOUT_KEYS: ClassVar[frozenset[str]] = frozenset()

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
    perf: PerfConfig = Field(default_factory=PerfConfig)

    @model_validator(mode="after")
    def _rollout_keys_read(self) -> TrainerConfig:
        rollout = getattr(self, "rollout", None)
        if isinstance(rollout, BaseModel):
            _check_rollout(self.trainer, type(self).ROLLOUT_KEYS, rollout)
        return self

    @model_validator(mode="after")
    def _optimizer_fits(self) -> TrainerConfig:
        optims = [("optim", getattr(self, "optim", None))]
        value = getattr(self, "value", None)
        optims.append(("value.optim", getattr(value, "optim", None)))
        import importlib.util

        for field, optim in optims:
            if not isinstance(optim, OptimConfig) or optim.name == "adamw":
                continue
            if importlib.util.find_spec("torchao") is None:
                raise ValueError(
                    f"{field}.name: {optim.name} needs torchao (pip install 'rlhflab[lowmem]')"
                )
            if optim.name == "adamw_bf16" and (
                self.model.dtype != "bfloat16" or self.model.lora is not None
            ):
                raise ValueError(
                    f"{field}.name: adamw_bf16 keeps bfloat16 weights and rounds each update "
                    f"stochastically; it needs model.dtype: bfloat16 without model.lora (got "
                    f"model.dtype: {self.model.dtype}"
                    f"{', model.lora set' if self.model.lora is not None else ''})"
                )
        return self


def _covers(keys: frozenset[str], dotted: str) -> bool:
    """Whether `dotted` is one of `keys` or lies in a section that one of them names."""
    return any(dotted == k or dotted.startswith(k + ".") for k in keys)


def _families() -> dict[str, type[TrainerConfig]]:
    """`trainer` value -> config class of every family defined (subclasses of TrainerConfig;
    the loader's CONFIG_CLASSES, without importing the loader)."""
    out, todo = {}, [TrainerConfig]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        tag = cls.model_fields["trainer"].default
        if isinstance(tag, str):
            out[tag] = cls
    return dict(sorted(out.items()))


def _set_keys(section: BaseModel, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of `section` whose value is not its field's default
    (the class's default: a family's own default for a whole section does not count)."""
    out = []
    for name, field in type(section).model_fields.items():
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            out += _set_keys(value, f"{prefix}{name}.")
        elif value != field.get_default(call_default_factory=True):
            out.append((f"{prefix}{name}", value))
    return out


def _yaml_text(value: Any) -> str:
    """A config value as written in YAML: true/false/null, numbers and text as they are."""
    import json

    return json.dumps(value) if isinstance(value, bool | None | list) else str(value)


def _check_rollout(trainer: str, read: frozenset[str], rollout: BaseModel) -> None:
    """Refuse a `rollout` setting the trainer would ignore (see `TrainerConfig`).

    Raises:
        ValueError: one line naming the key, its value and who reads it:
            "rollout.mode: async is not implemented for trainer distill (policy_gradient only)",
            "rollout.max_staleness: 2 is read with rollout.mode async only (rollout.mode is sync)".
    """
    set_keys = _set_keys(rollout)
    for key, value in set_keys:
        if not _covers(read, key):
            others = [t for t, c in _families().items() if _covers(c.ROLLOUT_KEYS, key)]
            where = (
                f"{others[0]} only" if len(others) == 1
                else f"implemented by {', '.join(others)}" if others
                else "no trainer reads it"
            )  # fmt: skip
            raise ValueError(
                f"rollout.{key}: {_yaml_text(value)} is not implemented for trainer {trainer} "
                f"({where})"
            )
    only_with = getattr(type(rollout), "ONLY_WITH", ())
    for key, value in set_keys:
        for covered, (needs, wanted) in only_with:
            current = rollout
            for part in needs.split("."):
                current = getattr(current, part)
            if _covers(frozenset({covered}), key) and current != wanted:
                raise ValueError(
                    f"rollout.{key}: {_yaml_text(value)} is read with rollout.{needs} "
                    f"{_yaml_text(wanted)} only (rollout.{needs} is {_yaml_text(current)})"
                )


# ---------------------------------------------------------------------------------------------
# Sections two families share
# ---------------------------------------------------------------------------------------------


class PromptDataConfig(Strict):
    """Where on-policy prompts come from (see rlhflab.data.prompts).

    source "task": the `task` section's reasoning_gym task (its verifier is `correctness`).
    source "env": the rows of the `env` section's environment (`prompt_rows()`: a verifiers
    environment's dataset and eval dataset, an OpenEnv environment's reset seeds;
    docs/environments.md). `max_rows` and `n_heldout` apply; `template` does not.
    source "dataset": `path`, a Hub id (`datasets.load_dataset(path, name, split=split)`) or a local
    .json/.jsonl/.parquet file in TRL's prompt-only formats; `prompt_column` names the prompt
    (GSM8K `question`, MATH `problem`); `prompt_format: hh_transcript` reads an HH-RLHF transcript
    column (`chosen`) and keeps the turns before the last assistant turn. Held out: `heldout_split`
    (a named split), `heldout_path` (a local file), or else a seeded `heldout_frac` of the rows;
    held-out prompts equal to training prompts are dropped and counted.
    """

    source: Literal["task", "dataset", "env"] = "task"
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
        if self.source == "env" and (self.path or self.heldout_path or self.heldout_split):
            raise ValueError(
                "data.path: data.source 'env' takes its rows from the environment's dataset; "
                "remove data.path / heldout_path / heldout_split"
            )
        if self.source == "env" and self.template is not None:
            raise ValueError(
                "data.template: the environment renders its own messages with data.source 'env'"
            )
        if self.template is not None and "{prompt}" not in self.template:
            raise ValueError("data.template must contain '{prompt}'")
        if self.heldout_split and self.heldout_path:
            raise ValueError("set at most one of data.heldout_split and data.heldout_path")
        return self


class JudgeCriterion(Strict):
    """One criterion of a rubric judge: its name (logged as `reward/<label>/<name>`), weight in
    the weighted mean Σ_c w_c s_c / Σ_c w_c, and the description the template shows."""

    name: str = Field(min_length=1)
    weight: float = Field(1.0, gt=0)
    description: str | None = None


class JudgeArgs(Strict):
    """`reward.components[judge].args` (`rlhflab.rewards.judge.judge_component`): an LLM judge
    (a causal LM at `path`, or a run directory's model) prompted with `template`, decoded
    greedily, parsed by `parse_score` (the first integer after `marker`, in [low, high])."""

    path: str = Field(min_length=1)
    mode: Literal["pointwise", "rubric"] = "pointwise"
    template: str | None = None  # None: rlhflab.rewards.judge.DEFAULT_TEMPLATES[mode]
    marker: str = Field("Score:", min_length=1)
    low: int = 1
    high: int = 10
    criteria: list[JudgeCriterion] | None = None  # rubric only
    on_parse_failure: Literal["error", "nan", "min"] = "error"
    judge_max_new_tokens: int = Field(16, ge=1)  # the judge's answer budget, not the policy's
    batch_size: int = Field(32, ge=1)
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    # "vllm": the judge's own vLLM engine (vLLM installed; the run's rollout.vllm, this dtype)
    engine: Literal["hf", "vllm"] = "hf"

    @model_validator(mode="after")
    def _consistent(self) -> JudgeArgs:
        from rlhflab.rewards.judge import check_template

        if self.engine == "vllm" and self.dtype == "float64":
            raise ValueError("dtype: float64 is not a vLLM dtype (engine 'vllm'); use float32")
        if self.low >= self.high:
            raise ValueError(f"low: must be below high, got low={self.low}, high={self.high}")
        if (self.mode == "rubric") != bool(self.criteria):
            raise ValueError("criteria: a rubric needs at least one criterion, and only a "
                             "rubric takes criteria")  # fmt: skip
        names = [c.name for c in self.criteria or []]
        if len(set(names)) != len(names):
            raise ValueError(f"criteria: names repeat: {names}")
        import re

        for name in names:  # logged as rollout/reward/<label>/<name>_mean
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name == "parse_failed":
                raise ValueError(f"criteria: {name!r} is not a metric name (letters, digits, "
                                 "_ . -; and not 'parse_failed', the failure count's)")  # fmt: skip
        if self.template is not None:
            try:
                check_template(self.template, self.mode, field="template")
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return self


class RewardComponentConfig(Strict):
    """One reward term: weight · component, logged as rollout/reward/<name>_mean.

    `name` is a named component (REWARD_COMPONENTS: correctness, format, length, overlong,
    reward_model, judge — whose args `JudgeArgs` validates) or a built-in reward function (REWARD_FUNCTIONS: math_verify, exact_match,
    think_format); or set `function` to a TRL-convention reward function by import path
    ("pkg.module:fn" or "path/to/file.py:fn"), then `name` is its label (default: the function's
    name). `args` are keyword arguments (checked against named components' signatures).
    A reward_model component with `args.credit: dense` (a PRM) gives per-step rewards at the
    step-separator tokens instead of one per completion (docs/reward_models.md).
    """

    name: str | None = None
    function: str | None = None
    label: str | None = None  # the logged name when `name` repeats (two reward models)
    weight: float = 1.0
    args: dict[str, Any] = Field(default_factory=dict)

    @property
    def dense(self) -> bool:
        """Per-token credit: a reward_model component with `args.credit: dense` (a PRM's
        per-step rewards at the step-separator tokens, `rlhflab.rewards.reward_model`)."""
        return (
            self.function is None
            and self.name == "reward_model"
            and (self.args.get("credit") == "dense")
        )

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
        if self.name == "judge":
            self._check_judge_args()
        if self.name == "reward_model" and "credit" in self.args:
            from rlhflab.rewards.reward_model import CREDITS, check_dense_credit

            if self.args["credit"] not in CREDITS:
                raise ValueError(
                    f"reward.components[reward_model].args.credit: one of {', '.join(CREDITS)}, "
                    f"got {self.args['credit']!r}"
                )
            if self.dense:
                try:
                    check_dense_credit(
                        kind=self.args.get("kind", "preference"),
                        normalize=self.args.get("normalize", "none"),
                        retokenize=self.args.get("retokenize", False),
                    )
                except ConfigError as exc:
                    raise ValueError(str(exc)) from None
        return self

    def _check_judge_args(self) -> None:
        """Validate a judge's args by `JudgeArgs` (one line naming the field); keep them as
        plain values; a NaN on parse failure may only be logged (weight 0)."""
        from pydantic import ValidationError

        where = f"reward.components[{self.label or 'judge'}].args"
        try:
            args = JudgeArgs(**self.args)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            raise ValueError(f"{where}{'.' + loc if loc else ''}: {msg}") from None
        if args.on_parse_failure == "nan" and self.weight != 0:
            raise ValueError(
                f"{where}.on_parse_failure: 'nan' needs weight 0 (a NaN may not reach the "
                "loss); use 'min' or 'error' for a judge that is trained on"
            )
        self.args = args.model_dump(exclude_unset=True)

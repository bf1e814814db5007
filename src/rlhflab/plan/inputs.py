"""An rlhflab config as `PlanInputs` (`inputs_from_config`), and `plan`: the `rlhflab plan`
result (the estimate of `rlhflab.plan.memory`, its inputs, the largest micro-batch that fits)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from rlhflab.plan.memory import _DTYPE_BYTES, PlanInputs, estimate, max_micro_batch
from rlhflab.plan.shapes import ModelShape, resolve_shape


def _local_shape(path: str | None, fallback: ModelShape) -> ModelShape:
    """The shape at a local model directory `path`, else `fallback` (a hub id cannot be read
    offline; a reward model is assumed to be the policy's shape then)."""
    if path and (Path(path) / "config.json").is_file():
        return resolve_shape(path, what="reward.components[reward_model].args.path")
    return fallback


def inputs_from_config(
    cfg,
    shape: ModelShape,
    *,
    gpus: int,
    gpu_memory_gib: float,
    prompt_len: int | None = None,
    completion_len: int | None = None,
    activation_checkpointing: bool = False,
    reference_dtype: str | None = None,
) -> tuple[PlanInputs, int]:
    """PlanInputs of an rlhflab config (`rlhflab.config.load_config`) on `gpus` GPUs, and the
    largest micro-batch worth trying (the rows one rank trains per optimizer step).

    prompt_len: prompt tokens where the config does not bound them (policy-gradient prompts, DPO
    pairs without data.max_prompt_len); None: 256 (0 for SFT / RM, whose max_len bounds the whole
    sequence). completion_len: overrides the config's max_new_tokens / max_len / completion bound.
    """
    trainer = cfg.trainer
    par = cfg.parallel
    strategy = par.strategy
    if strategy == "auto":
        strategy = "ddp" if gpus > 1 else "none"
    ranks = gpus if strategy != "none" else 1
    lora = cfg.model.lora
    p = PlanInputs(
        trainer=trainer,
        gpus=gpus,
        gpu_memory_gib=gpu_memory_gib,
        strategy=strategy,
        mixed_precision=par.mixed_precision,
        cpu_offload=par.cpu_offload,
        model_dtype=cfg.model.dtype,
        autocast=cfg.precision.autocast != "none",
        lora_r=lora.r if lora is not None else None,
        lora_targets=lora.target_modules if lora is not None else "all-linear",
        activation_checkpointing=activation_checkpointing or cfg.model.gradient_checkpointing,
        reference_dtype=reference_dtype,
        optimizer=getattr(getattr(cfg, "optim", None), "name", "adamw"),
    )
    default_prompt = 256 if prompt_len is None else prompt_len
    if trainer == "policy_gradient":
        ro = cfg.rollout
        batch = ro.prompts_per_step * ro.group_size
        per_rank = max(1, batch // ranks)
        limit = max(1, batch // cfg.train.minibatches // ranks)
        p.micro_batch = min(cfg.train.micro_batch_size, limit)
        p.prompt_len = default_prompt
        p.completion_len = completion_len or ro.max_new_tokens
        p.rollout_rows, p.rollout_rows_global = per_rank, batch
        p.temperature = ro.temperature
        p.half_weights = ro.engine == "hf" and ro.half_weights
        p.reference = cfg.kl.coef > 0
        p.critic = cfg.value is not None
        p.critic_init_from = p.critic and bool(cfg.value.init_from)
        steps_per_batch = cfg.train.update_epochs * cfg.train.minibatches
        p.scoring_passes = steps_per_batch > 1 or (p.reference and cfg.kl.placement != "loss")
        rm = [c for c in cfg.reward.components if c.name == "reward_model"]
        if rm:
            p.reward_model = _local_shape(rm[0].args.get("path"), shape)
    elif trainer == "direct_alignment":
        d, v = cfg.data, cfg.verifiable
        p.rows_per_example = 2
        limit = max(1, cfg.train.batch_size // ranks)
        p.micro_batch = min(cfg.train.micro_batch_size, limit)
        p.prompt_len = d.max_prompt_len or default_prompt
        if d.source == "verifiable":
            p.loads_full = True  # samples before wrap: the model on every rank's device
            p.completion_len = completion_len or v.max_new_tokens
            p.rollout_rows = p.rollout_rows_global = min(
                cfg.eval.batch_size, v.n_prompts * v.samples_per_prompt
            )
        else:
            p.completion_len = completion_len or d.max_completion_len or 256
        p.scoring_passes = True  # reference log-probs, once per round, without gradients
    elif trainer in ("sft", "reward_model"):
        max_len = cfg.train.max_len if trainer == "sft" else cfg.data.max_len
        if trainer == "reward_model" and cfg.kind == "preference":
            p.rows_per_example = 2
        limit = max(1, cfg.train.batch_size // ranks)
        p.micro_batch = min(cfg.train.micro_batch_size, limit)
        p.prompt_len = 0 if prompt_len is None else prompt_len
        p.completion_len = completion_len or max(1, max_len - p.prompt_len)
    else:
        raise ValueError(f"trainer: {trainer!r} is not planned")
    budget = cfg.train.max_tokens_per_micro_batch
    if budget is not None:  # as many full-length rows as the token budget holds (at least one)
        row = p.rows_per_example * (p.prompt_len + p.completion_len)
        p.micro_batch = max(1, min(limit, budget // row))
    return p, limit


MICRO_BATCH_KEY = "train.micro_batch_size"


def micro_batches(cfg) -> list[int] | None:
    """The micro-batch sizes a config allows, ascending: the divisors of `train.batch_size`
    (SFT, DPO, reward models: their configs refuse any other); None: any size (the policy
    gradient splits its rollout batch into micro-batches of at most the size)."""
    if cfg.trainer == "policy_gradient":
        return None
    batch = cfg.train.batch_size
    return [d for d in range(1, batch + 1) if batch % d == 0]


def _given_micro_batch(overrides: list[str]) -> bool:
    """Whether the overrides set the micro-batch (`train.micro_batch_size=N`)."""
    return any(o.split("=", 1)[0].strip() == MICRO_BATCH_KEY for o in overrides)


@dataclasses.dataclass
class PlanSetting:
    """Everything `plan` was asked, to re-plan the run with extra overrides or another GPU count
    (`at`; `rlhflab.plan.suggest` asks for each change it tries)."""

    model: str
    shape: ModelShape
    gpus: int
    gpu_memory_gib: float
    config: str | None = None
    overrides: list[str] = dataclasses.field(default_factory=list)
    prompt_len: int | None = None
    completion_len: int | None = None
    activation_checkpointing: bool = False
    reference_dtype: str | None = None

    def gives_micro_batch(self, extra: list[str] | tuple[str, ...] = ()) -> bool:
        """Whether the user's overrides (then `extra`) set the micro-batch."""
        return _given_micro_batch([*self.overrides, *extra])

    def load(self, extra: list[str]):
        """The run's config with the user's overrides, then `extra`."""
        from rlhflab.config import apply_overrides, config_from_dict, load_config

        over = [*self.overrides, *extra]
        if self.config is not None:
            return load_config(self.config, over)
        raw = apply_overrides({"trainer": "policy_gradient"}, over)
        raw.setdefault("model", {})
        if isinstance(raw["model"], dict) and "build" not in raw["model"]:
            raw["model"].setdefault("name_or_path", self.model)
        return config_from_dict(raw, source="plan")

    def at(self, extra: list[str] | None = None, gpus: int | None = None) -> dict:
        """The plan with `extra` overrides after the user's, on `gpus` GPUs (default the
        user's): `estimate`'s dict plus "inputs", "max_micro_batch" (the largest in 1..limit
        that fits and the config allows, `micro_batches`; 0: none), "micro_batch_limit",
        "micro_batch_searched" and "config_micro_batch". The micro-batch is the one the
        overrides set; when they set none it is the largest that fits (1 when none does), not
        the config's (the presets' are CPU values). With `train.max_tokens_per_micro_batch` it
        is the number of full-length rows (prompt + completion tokens) the budget holds, at
        least 1 (a longer row goes alone); "token_budget" says so.

        Raises:
            ConfigError: a bad override or config; ValueError: an estimate's own check.
        """
        extra = list(extra or [])
        gpus = self.gpus if gpus is None else gpus
        cfg = self.load(extra)
        p, limit = inputs_from_config(
            cfg, self.shape, gpus=gpus, gpu_memory_gib=self.gpu_memory_gib,
            prompt_len=self.prompt_len, completion_len=self.completion_len,
            activation_checkpointing=self.activation_checkpointing,
            reference_dtype=self.reference_dtype,
        )  # fmt: skip
        best = max_micro_batch(self.shape, p, limit)
        valid = micro_batches(cfg)
        if valid is not None:  # the largest allowed one at or below the largest that fits
            best = max((m for m in valid if m <= best), default=0)
        budget = cfg.train.max_tokens_per_micro_batch
        searched = not self.gives_micro_batch(extra) and budget is None
        if searched:
            p.micro_batch = max(1, best)
        out = estimate(self.shape, p)
        out["max_micro_batch"] = best
        out["micro_batch_limit"] = limit
        out["micro_batch_searched"] = searched
        out["config_micro_batch"] = cfg.train.micro_batch_size
        out["token_budget"] = budget
        inputs = dataclasses.asdict(p)
        inputs["reward_model"] = p.reward_model.name if p.reward_model else None
        out["inputs"] = inputs
        return out


def _context_fields(trainer: str, prompt_given: bool, completion_given: bool) -> str:
    """The options / config fields that set the planned prompt and completion lengths."""
    if trainer in ("sft", "reward_model"):
        length = "train.max_len" if trainer == "sft" else "data.max_len"
        return f"--prompt-len, {length}" if prompt_given else length
    prompt = "--prompt-len" if prompt_given or trainer != "direct_alignment" else (
        "data.max_prompt_len (or --prompt-len)")  # fmt: skip
    if completion_given:
        completion = "--completion-len"
    elif trainer == "policy_gradient":
        completion = "rollout.max_new_tokens"
    else:
        completion = "data.max_completion_len / verifiable.max_new_tokens (or --completion-len)"
    return f"{prompt}, {completion}"


def _check_context(shape: ModelShape, inputs: dict, *, prompt_given: bool,
                   completion_given: bool) -> None:  # fmt: skip
    """Refuse a plan whose sequences (prompt + completion tokens) are longer than the model's
    positions (`ModelShape.max_position_embeddings`; not checked when unknown).

    Raises:
        ConfigError: one line with both lengths, the model's limit and the fields that set them.
    """
    from rlhflab.errors import ConfigError

    limit = shape.max_position_embeddings
    prompt, completion = inputs["prompt_len"], inputs["completion_len"]
    if limit is None or prompt + completion <= limit:
        return
    fields = _context_fields(inputs["trainer"], prompt_given, completion_given)
    raise ConfigError(
        f"does not fit the model's context: prompt {prompt} + completion {completion} = "
        f"{prompt + completion} tokens > {limit} (max_position_embeddings of {shape.name}); "
        f"lower {fields}"
    )


def plan(
    model: str,
    *,
    gpus: int,
    gpu_memory_gib: float,
    config: str | None = None,
    overrides: list[str] | None = None,
    prompt_len: int | None = None,
    completion_len: int | None = None,
    activation_checkpointing: bool = False,
    reference_dtype: str | None = None,
    suggest: bool = True,
) -> dict:
    """The `rlhflab plan` result: `estimate` of the run, its inputs, the largest micro-batch and,
    when it does not fit, the changes that make it fit (`rlhflab.plan.suggest`).

    model: a built-in shape, a Hub id of one (`Qwen/Qwen3-8B`) or a local model directory
    (`resolve_shape`). config: an rlhflab preset (loaded with `rlhflab.config.load_config`,
    overrides applied); None: a policy-gradient run with every default (overrides such as
    `trainer=sft` pick another). Without a `train.micro_batch_size=N` override the run is judged
    at the largest micro-batch that fits (`PlanSetting.at`).
    Returns: `PlanSetting.at`'s dict with "model" (the shape), "config", "overrides" and, when
    the run or its loading does not fit and `suggest`, "suggestions" (`fit_suggestions`).
    Raises ConfigError (one line) on a bad model, config, override or number.
    """
    from rlhflab.errors import ConfigError
    from rlhflab.plan.suggest import fit_suggestions

    if gpus < 1:
        raise ConfigError(f"--gpus: must be >= 1, got {gpus}")
    if not (math.isfinite(gpu_memory_gib) and gpu_memory_gib > 0):
        raise ConfigError(f"--gpu-memory: must be a finite number of GiB > 0, got {gpu_memory_gib}")
    for name, v in (("--prompt-len", prompt_len), ("--completion-len", completion_len)):
        if v is not None and v < (0 if name == "--prompt-len" else 1):
            raise ConfigError(f"{name}: must be >= {0 if name == '--prompt-len' else 1}, got {v}")
    if reference_dtype not in (None, *_DTYPE_BYTES):
        raise ConfigError(f"--reference-dtype: choose one of {', '.join(_DTYPE_BYTES)}")
    try:
        shape = resolve_shape(model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    setting = PlanSetting(
        model, shape, gpus, gpu_memory_gib, config, list(overrides or []), prompt_len,
        completion_len, activation_checkpointing, reference_dtype,
    )  # fmt: skip
    try:
        out = setting.at()
        _check_context(shape, out["inputs"], prompt_given=prompt_len is not None,
                       completion_given=completion_len is not None)  # fmt: skip
        suggestions = (
            fit_suggestions(setting, out) if suggest and not (out["fits"] and out["load_fits"])
            else None
        )  # fmt: skip
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    result = {
        "model": dataclasses.asdict(shape),
        "config": config,
        "overrides": list(overrides or []),
        **out,
    }
    if suggestions is not None:
        result["suggestions"] = suggestions
    return result

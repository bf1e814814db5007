"""Typed run configs: one pydantic model per trainer family, loaded from YAML with dotted overrides.

A config file is flat and complete: the file you read is the run you get. Its top-level key
`trainer` names the family (`sft`, `policy_gradient`, ...). Unknown keys are errors that name the
full dotted path and suggest the closest valid key; a loss's keyword arguments are checked against
the function's signature when the config is loaded, not when the loss is first called.

    cfg = load_config("configs/pg/grpo.yaml", ["rollout.group_size=16", "optim.lr=1e-5"])

Modules, by concern: `base` (the `Strict` base and the validators' checks), `sections` (sections
every family shares, and `TrainerConfig`), one module per trainer family (`sft`,
`policy_gradient`, `direct_alignment`, `reward_model`: its own sections and top-level class), and
`loader` (YAML, overrides, the `trainer`-discriminated union `AnyConfig`, `load_config`).
"""

from rlhflab.config.base import (
    SEED_MAX,
    Strict,
    _check_clip_bounds,
    _check_kwargs,
    _check_micro,
    _check_name,
    _wants_number,
    did_you_mean,
)
from rlhflab.config.direct_alignment import (
    DPOConfig,
    DPODataConfig,
    DPOEvalConfig,
    DPOLossConfig,
    DPOTrainConfig,
    VerifiablePairsConfig,
)
from rlhflab.config.distill import DistillConfig, DistillLossConfig, SDPOConfig, TeacherConfig
from rlhflab.config.loader import (
    CONFIG_CLASSES,
    AnyConfig,
    _format_error,
    _section_class,
    apply_overrides,
    config_from_dict,
    config_has_key,
    dump_config,
    full_finetune_precision_warning,
    key_hint,
    load_config,
    override_value,
    read_yaml,
)
from rlhflab.config.policy_gradient import (
    DynamicSamplingConfig,
    KLConfig,
    LossConfig,
    PGConfig,
    PGTrainConfig,
    RewardConfig,
    RolloutConfig,
    TISConfig,
    ValueConfig,
    VLLMConfig,
)
from rlhflab.config.reward_model import (
    RMConfig,
    RMDataConfig,
    RMEvalConfig,
    RMLossConfig,
    RMTrainConfig,
)
from rlhflab.config.sections import (
    MAX_SECONDS_DOC,
    BuildConfig,
    CheckpointConfig,
    EvalConfig,
    HealthConfig,
    LoRAConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    PromptDataConfig,
    RewardComponentConfig,
    RunConfig,
    TaskConfig,
    TrackingConfig,
    TrackioConfig,
    TrainBase,
    TrainerConfig,
    WandbConfig,
)
from rlhflab.config.sft import SFTConfig, SFTDataConfig, SFTTrainConfig
from rlhflab.errors import ConfigError

__all__ = [
    "CONFIG_CLASSES",
    "MAX_SECONDS_DOC",
    "SEED_MAX",
    "AnyConfig",
    "BuildConfig",
    "CheckpointConfig",
    "ConfigError",
    "DPOConfig",
    "DPODataConfig",
    "DPOEvalConfig",
    "DPOLossConfig",
    "DPOTrainConfig",
    "DistillConfig",
    "DistillLossConfig",
    "DynamicSamplingConfig",
    "EvalConfig",
    "HealthConfig",
    "KLConfig",
    "LoRAConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "PGConfig",
    "PGTrainConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "PromptDataConfig",
    "RMConfig",
    "RMDataConfig",
    "RMEvalConfig",
    "RMLossConfig",
    "RMTrainConfig",
    "RewardComponentConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SDPOConfig",
    "SFTConfig",
    "SFTDataConfig",
    "SFTTrainConfig",
    "Strict",
    "TISConfig",
    "TaskConfig",
    "TeacherConfig",
    "TrackingConfig",
    "TrackioConfig",
    "TrainBase",
    "TrainerConfig",
    "VLLMConfig",
    "ValueConfig",
    "VerifiablePairsConfig",
    "WandbConfig",
    "_check_clip_bounds",
    "_check_kwargs",
    "_check_micro",
    "_check_name",
    "_format_error",
    "_section_class",
    "_wants_number",
    "apply_overrides",
    "config_from_dict",
    "config_has_key",
    "did_you_mean",
    "dump_config",
    "full_finetune_precision_warning",
    "key_hint",
    "load_config",
    "override_value",
    "read_yaml",
]

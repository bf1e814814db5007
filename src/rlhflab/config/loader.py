"""Loading configs: YAML files, dotted overrides, validation into the family named by `trainer`.

`AnyConfig` is the one table of trainer families: a pydantic union discriminated by the
top-level `trainer` key; `CONFIG_CLASSES` maps each `trainer` value to its class (derived from
it). Errors are one-line ConfigErrors that name the file and the full dotted key, and suggest the
closest valid key.
"""

from __future__ import annotations

import logging
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Union

import yaml
from pydantic import BaseModel, Discriminator, Tag, TypeAdapter, ValidationError

from rlhflab.config.base import did_you_mean
from rlhflab.config.direct_alignment import DPOConfig
from rlhflab.config.distill import DistillConfig
from rlhflab.config.policy_gradient import PGConfig
from rlhflab.config.reward_model import RMConfig
from rlhflab.config.sections import TrainerConfig
from rlhflab.config.sft import SFTConfig
from rlhflab.errors import ConfigError


def _trainer_of(raw: Any) -> Any:
    """The `trainer` value of a raw config (a dict) or of a config object: the union's tag."""
    return raw.get("trainer") if isinstance(raw, dict) else getattr(raw, "trainer", None)


def _family(cls: type[TrainerConfig]) -> Any:
    """`cls` tagged with the value of its `trainer` field, as a member of `AnyConfig`."""
    return Annotated[cls, Tag(cls.model_fields["trainer"].default)]


#: The one table of trainer families: their config classes, discriminated by `trainer` (listed
#: in this order in error messages). The discriminator is a function, not
#: `Field(discriminator="trainer")`, because pydantic refuses a field with a mode="before"
#: validator (`Strict`'s true/false check) as a discriminator.
AnyConfig = Annotated[
    Union[  # noqa: UP007
        _family(SFTConfig),
        _family(PGConfig),
        _family(DPOConfig),
        _family(RMConfig),
        _family(DistillConfig),
    ],
    Discriminator(_trainer_of),
]

#: `trainer` value -> config class, in the union's order (derived from `AnyConfig`).
CONFIG_CLASSES: dict[str, type[TrainerConfig]] = {
    tag.tag: cls
    for cls, tag in (
        typing.get_args(member) for member in typing.get_args(typing.get_args(AnyConfig)[0])
    )
}

_ANY_CONFIG: TypeAdapter = TypeAdapter(AnyConfig)

logger = logging.getLogger(__name__)

#: Significant bits (stored mantissa + the implicit one) of the 16-bit parameter dtypes.
SIGNIFICANT_BITS = {"bfloat16": 8, "float16": 11}


def full_finetune_precision_warning(cfg: TrainerConfig) -> str | None:
    """One line when `cfg` fine-tunes every weight (no `model.lora`) held in a 16-bit
    `model.dtype`, else None.

    AdamW updates the parameters in their own dtype (`rlhflab.trainers.common.make_optimizer`).
    A float with p significant bits and |w| in [2^(e-1), 2^e) has spacing ulp(w) = 2^(e-p), and
    w + δ rounds back to w when |δ| < ulp(w)/2 = 2^(e-p-1); AdamW's step is about optim.lr per
    weight, so it is lost on every weight with |w| > 2^(p+1)·lr (bfloat16, p = 8: |w| > 512·lr,
    5.1e-3 at lr 1e-5, most weights of a pretrained model). The fix is the project's mixed
    precision: float32 master weights (`model.dtype: float32`) with bf16 compute
    (`precision.autocast: bf16`, or `parallel.mixed_precision: bf16` under FSDP2).
    """
    bits = SIGNIFICANT_BITS.get(cfg.model.dtype)
    if bits is None or cfg.model.lora is not None:
        return None
    if getattr(getattr(cfg, "optim", None), "name", "adamw") == "adamw_bf16":
        return None  # stochastic rounding keeps the small updates in expectation
    lr = cfg.optim.lr
    return (
        f"model.dtype: {cfg.model.dtype} with full fine-tuning (no model.lora): AdamW updates "
        f"the {cfg.model.dtype} weights in place, and its step of about optim.lr = {lr:g} rounds "
        f"away on every weight with |w| > 2^{bits + 1}·lr = {2 ** (bits + 1) * lr:.3g} "
        f"({cfg.model.dtype} keeps {bits} significant bits); set model.dtype: float32 with "
        "precision.autocast: bf16 (float32 master weights, bf16 compute; under FSDP2 "
        "parallel.mixed_precision: bf16)"
    )


_WARNED: set[str] = set()


def _warn_once(cfg: TrainerConfig) -> None:
    """Log `full_finetune_precision_warning` (once per process and message: a sweep loads the
    same config per cell, a resume reloads it)."""
    msg = full_finetune_precision_warning(cfg)
    if msg is not None and msg not in _WARNED:
        _WARNED.add(msg)
        logger.warning("warning: %s", msg)


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


def key_hint(cls: type[BaseModel], key: str) -> str:
    """A did-you-mean hint for a dotted config key `key` that the config class `cls` does not
    have: the closest field of the section `key` names (of the top level when that section does
    not exist), as " (did you mean 'x'?)"-style text; "" when nothing is close."""
    parts = key.split(".")
    parent = _section_class(cls, tuple(parts[:-1]))
    if parent is not None:
        return did_you_mean(parts[-1], parent.model_fields)
    return did_you_mean(parts[0], cls.model_fields)


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
    """One line for the first error of validating through `AnyConfig` as the family `cls`: its
    location starts with the `trainer` tag, left out here (locations are keys of `cls`)."""
    first = err.errors()[0]
    loc = tuple(first["loc"])[1:]
    dotted = ".".join(str(p) for p in loc)
    if first["type"] == "extra_forbidden":
        parent = _section_class(cls, loc[:-1])
        hint = did_you_mean(str(loc[-1]), parent.model_fields) if parent else ""
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
    """Validate a raw dict into the config class named by its `trainer` key (through `AnyConfig`).

    Raises ConfigError, one line starting with `source`: when `raw` is not a mapping, when
    `trainer` is missing or not one of CONFIG_CLASSES (with did-you-mean), or on the first
    validation error (the full dotted key; did-you-mean for unknown keys). A valid config that
    fully fine-tunes 16-bit weights gets a one-line warning (logger `rlhflab.config.loader`;
    `full_finetune_precision_warning`), once per process.
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    trainer = raw.get("trainer")
    if not isinstance(trainer, str) or trainer not in CONFIG_CLASSES:
        raise ConfigError(
            f"{source}: 'trainer' must be one of {', '.join(CONFIG_CLASSES)} "
            f"(got {trainer!r}){did_you_mean(str(trainer), CONFIG_CLASSES)}"
        )
    cls = CONFIG_CLASSES[trainer]
    try:
        cfg = _ANY_CONFIG.validate_python(raw)
    except ValidationError as err:
        raise ConfigError(f"{source}: {_format_error(cls, err)}") from None
    _warn_once(cfg)
    return cfg


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

"""Load pretrained models and tokenizers by Hugging Face Hub id or local path.

Every failure becomes a one-line `ModelError` (or `ConfigError` for a bad option); the original
exception is chained (`raise ... from`) for debugging but never shown as the user's error.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers import PreTrainedTokenizerBase as Tokenizer

import rlhflab.models.gpt  # noqa: F401  (registers model_type "rlhflab_gpt" with transformers)
from rlhflab.errors import ConfigError, ModelError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


#: The name rlhflab gives a run directory: <run.name>-<YYYYmmdd>-<HHMMSS>[-i] (rlhflab.rundir).
RUN_DIR_NAME = re.compile(r"-\d{8}-\d{6}(-\d+)?$")


def local_path_reason(name: str) -> str | None:
    """Why `name` is read as a local path and never looked up on the Hugging Face Hub, or None
    when it may be a Hub id.

    A Hub id is "name" or "owner/name" (letters, digits, "-", "_", "."; huggingface_hub's
    `validate_repo_id`), so one "/" alone is ambiguous: "runs/sftmodel" is a legal Hub id. It is
    read as a path when its first component is a local directory (`runs/` exists: a mistyped
    run, not a Hub repo named "runs") or a component is an rlhflab run directory's name
    (`<name>-<date>-<time>`). Names starting with ".", "~" or "/", with two or more "/", with a
    backslash, or that no Hub id can spell are paths too.
    """
    if name.startswith((".", "~", "/", os.sep)):
        return "it starts with '.', '~' or '/'"
    if name.count("/") >= 2:
        return "it has more than one '/' (a Hub id is owner/name)"
    if "\\" in name or (os.sep != "/" and os.sep in name):
        return "it has a backslash"
    first = name.split("/")[0]
    if "/" in name and os.path.isdir(first):
        return f"{first}/ is a local directory"
    if any(RUN_DIR_NAME.search(part) for part in name.split("/")):
        return "a run directory's name (<name>-<date>-<time>) is in it"
    try:
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(name)
    except ImportError:  # pragma: no cover (transformers depends on huggingface_hub)
        pass
    except ValueError:  # HFValidationError
        return "no Hub id is spelled like it"
    return None


def _hub_offline() -> bool:
    try:
        from huggingface_hub.constants import is_offline_mode

        return bool(is_offline_mode())
    except ImportError:  # older huggingface_hub
        return os.environ.get("HF_HUB_OFFLINE", "0").upper() in {"1", "ON", "YES", "TRUE"}


def _one_line(exc: BaseException, limit: int = 300) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds anything of the model repo `repo_id`."""
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
        from huggingface_hub.file_download import repo_folder_name
    except ImportError:  # pragma: no cover
        return True  # let transformers decide
    return os.path.isdir(os.path.join(HF_HUB_CACHE, repo_folder_name(repo_id=repo_id,
                                                                     repo_type="model")))  # fmt: skip


def resolve_name_or_path(name_or_path: str) -> str:
    """The local path (`~` expanded) or Hub id to hand to transformers, decided without any
    network request.

    Raises:
        ModelError, one line, at once: an empty name; a name read as a local path
            (`local_path_reason`) that does not exist ("no such directory: <name> (read as a
            local path: <why>)"); with the Hub offline (HF_HUB_OFFLINE=1), a Hub id of which
            the local cache holds nothing (transformers would fail after looking).
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ModelError(f"model name or path must be a non-empty string, got {name_or_path!r}")
    path = os.path.expanduser(name_or_path)
    if os.path.exists(path):
        return path
    reason = local_path_reason(name_or_path)
    if reason is not None:
        raise ModelError(f"no such directory: {name_or_path} (read as a local path: {reason})")
    if _hub_offline() and not _in_hub_cache(name_or_path):
        raise ModelError(
            f"no such directory: {name_or_path}, and no Hub model of that id in the local "
            "cache (HF_HUB_OFFLINE=1)"
        )
    return name_or_path


def _load_error(what: str, name: str, resolved: str, exc: BaseException) -> ModelError:
    if not os.path.exists(resolved) and isinstance(exc, OSError) and _hub_offline():
        return ModelError(
            f"cannot load {what} '{name}': not found locally and the Hugging Face Hub is offline "
            "(HF_HUB_OFFLINE=1)"
        )
    return ModelError(f"cannot load {what} '{name}': {_one_line(exc)}")


def default_attn_implementation(device: str | torch.device) -> str:
    """ "flash_attention_2" if `flash_attn` imports and `device` is CUDA, else "sdpa"."""
    if torch.device(device).type == "cuda":
        try:
            import flash_attn  # noqa: F401
        except Exception:
            return "sdpa"
        return "flash_attention_2"
    return "sdpa"


def load_model(
    name_or_path: str,
    *,
    dtype: str = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    gguf_file: str | None = None,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """Load a causal LM with `AutoModelForCausalLM.from_pretrained` and move it to `device`.

    Args:
        name_or_path: Hub id ("Qwen/Qwen3-0.6B") or local directory (from `save_pretrained`).
            An existing local path wins; names that only a path can be, or whose first
            component is a local directory ("runs/sftmodel" with runs/ present), are never
            looked up on the Hub (see `local_path_reason`).
        dtype: "float32", "bfloat16", "float16" or "float64" (parameter dtype; float64 for
            exactness tests that must not depend on the CPU's float32 kernels).
        attn_implementation: passed to transformers; None picks `default_attn_implementation`.
        trust_remote_code: allow model code shipped with the checkpoint.
        gguf_file: file name inside `name_or_path` for GGUF checkpoints (needs the `gguf`
            package); the weights are dequantised to `dtype`.
        device: torch device string.

    Returns:
        The model (eval mode, as transformers returns it).

    Raises:
        ConfigError: `dtype` not one of `DTYPES` (names `model.dtype`).
        ModelError: a local path that does not exist ("no such directory: <path> (...)"), or
            a Hub id the offline cache lacks, both before any download is tried (`resolve_name_or_path`);
            any other loading failure, as one line.
    """
    if dtype not in DTYPES:
        raise ConfigError(
            f"model.dtype: unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}"
        )
    resolved = resolve_name_or_path(name_or_path)
    if attn_implementation is None:
        attn_implementation = default_attn_implementation(device)
    kwargs: dict = {
        "dtype": DTYPES[dtype],
        "attn_implementation": attn_implementation,
        "trust_remote_code": trust_remote_code,
    }
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    try:
        model = AutoModelForCausalLM.from_pretrained(resolved, **kwargs)
    except Exception as exc:
        raise _load_error("model", name_or_path, resolved, exc) from exc
    if gguf_file is not None:
        model = dequantised(model)
    if dtype == "float64":
        model = float64_exact(model)
    try:
        model = model.to(device)
    except Exception as exc:
        raise ModelError(
            f"cannot move model '{name_or_path}' to device {device!r}: {_one_line(exc)}"
        ) from exc
    return model


def empty_model(
    name_or_path: str,
    *,
    dtype: str = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """The causal LM `load_model` would return, on the meta device: built from its config.json
    (and generation_config.json when there is one), no weight read, no memory allocated. The
    model FSDP2 ranks other than 0 shard before rank 0's weights reach them
    (`rlhflab.distributed.wrap`). Arguments as `load_model` (attn_implementation None: "sdpa").

    Raises:
        ConfigError: `dtype` not one of `DTYPES`.
        ModelError: the config cannot be read or the model cannot be built (one line).
    """
    from transformers import AutoConfig, GenerationConfig

    if dtype not in DTYPES:
        raise ConfigError(
            f"model.dtype: unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}"
        )
    resolved = resolve_name_or_path(name_or_path)
    try:
        config = AutoConfig.from_pretrained(resolved, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config,
                dtype=DTYPES[dtype],
                attn_implementation=attn_implementation or "sdpa",
                trust_remote_code=trust_remote_code,
            )
    except Exception as exc:
        raise _load_error("model", name_or_path, resolved, exc) from exc
    with contextlib.suppress(OSError):  # none saved: from_pretrained keeps the default one too
        model.generation_config = GenerationConfig.from_pretrained(resolved)
    if dtype == "float64":
        model = float64_exact(model)
    return model.eval()


def _rms_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm forward (weight · x / sqrt(mean(x²) + eps)), computed in float32
    for half and float32 inputs as transformers does, and in float64 for float64 inputs."""
    input_dtype = hidden_states.dtype
    x = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(input_dtype)


def float64_exact(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in float64 end to end: parameters cast to float64, and transformers' RMSNorm
    layers (Llama, Qwen2/3, Mistral, ...: a module class named `*RMSNorm` with a
    `variance_epsilon`), which cast their input to float32 whatever its dtype (an upcast meant
    for bf16/fp16, a downcast of float64), compute in float64 instead.

    Without the second part, a "float64" model rounds every hidden state, and its gradient in
    the backward pass, to float32 at each norm: two computations of the same quantity that add
    in other orders (micro-batches, ranks, packed rows) then differ by ~1e-7 relative instead of
    ~1e-16. Used by `model.dtype: float64` (exactness tests). Mutates and returns `model`."""
    model.to(torch.float64)
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            # a partial, not a bound method: it pickles (a spawned generation process gets the
            # model by pickle, `rlhflab.rollout.async_process`)
            module.forward = functools.partial(_rms_norm, module)
    return model


def dequantised(model: PreTrainedModel) -> PreTrainedModel:
    """A plain copy of a model that transformers loaded from GGUF, which saves as a normal HF dir.

    transformers dequantises GGUF weights on load but keeps the model marked as quantized
    (`config.quantization_config`, `hf_quantizer`), and `save_pretrained` then refuses it ("The
    model is quantized with gguf and is not serializable"). This rebuilds the same class from the
    config without `quantization_config` and loads the (already dequantised) state dict into it,
    in the weights' dtype. Models that are not marked as quantized are returned unchanged.

    Raises:
        ModelError: the state dict does not fit the rebuilt model (names the first keys).
    """
    if getattr(model.config, "quantization_config", None) is None:
        return model
    raw = model.config.to_dict()
    raw.pop("quantization_config", None)
    config = model.config.__class__.from_dict(raw)
    config._attn_implementation = model.config._attn_implementation
    dtype = next(model.parameters()).dtype
    plain = model.__class__(config).to(dtype)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    missing = [k for k in missing if k not in _tied_keys(plain)]
    if missing or unexpected:
        raise ModelError(
            f"GGUF weights do not fit {type(plain).__name__}: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain.eval()


def _tied_keys(model: PreTrainedModel) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied) if model.config.tie_word_embeddings else set()


def load_tokenizer(
    name_or_path: str,
    *,
    trust_remote_code: bool = False,
    gguf_file: str | None = None,
) -> Tokenizer:
    """Load a tokenizer with `AutoTokenizer.from_pretrained`, ready for batched generation.

    Guarantees on the result:
        * a pad token: if the checkpoint has none, the eos token is used as pad (common for
          Llama-family checkpoints). Padding positions are masked by the attention mask, so this
          does not change log-probs; completions still end with a real eos id.
        * `padding_side == "left"` (prompts are left-padded for generation).

    Raises:
        ModelError: path does not exist / not available offline / other loading failure; or the
            tokenizer has neither a pad nor an eos token.
    """
    resolved = resolve_name_or_path(name_or_path)
    kwargs: dict = {"trust_remote_code": trust_remote_code}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved, **kwargs)
    except Exception as exc:
        raise _load_error("tokenizer", name_or_path, resolved, exc) from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(
                f"tokenizer '{name_or_path}' has neither a pad token nor an eos token; "
                "add one before training"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def context_length(model: PreTrainedModel) -> int:
    """Longest sequence (tokens) the model's position encoding is configured for.

    Reads, in order, `max_position_embeddings`, `n_positions`, `max_sequence_length`,
    `seq_length` from the (text) config.

    Raises:
        ModelError: none of these is set.
    """
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ModelError(
        f"cannot tell the context length of model type '{getattr(config, 'model_type', '?')}': "
        "its config has no max_position_embeddings"
    )

"""Build small decoder-only models from scratch (Qwen3 or Llama shape) for a given tokenizer.

Parameter counts below are for a 1024-token vocabulary with tied embeddings (embedding
`vocab × hidden` counted once):

| size   | hidden | layers | heads | kv heads | head_dim | intermediate | params  |
|--------|--------|--------|-------|----------|----------|--------------|---------|
| tiny   | 64     | 2      | 4     | 2        | 16       | 128          | ~0.13 M |
| small  | 128    | 2      | 4     | 2        | 32       | 512          | ~0.62 M |
| base   | 256    | 4      | 4     | 2        | 64       | 1024         | ~4.2 M  |
| medium | 384    | 6      | 6     | 2        | 64       | 1536         | ~13.4 M |

(Llama has no q/k norms and is a few hundred parameters smaller.) `base` is the 4.2 M model
measured on a 2-core CPU (train step 32×128 tokens ≈ 0.5 s on 2 CPU cores).
"""

from __future__ import annotations

import os

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from rlhflab.errors import ConfigError
from rlhflab.models.gpt import GPTConfig, GPTForCausalLM
from rlhflab.serialize import match_umask

SIZE_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    ),
    "small": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
    ),
    "base": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1024,
    ),
    "medium": dict(
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=1536,
    ),
}

ARCHITECTURES: dict[str, tuple[type, type]] = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "gpt": (GPTConfig, GPTForCausalLM),  # rlhflab.models.gpt, written from scratch
}


def build_model(
    tokenizer: PreTrainedTokenizerBase,
    *,
    size: str = "base",
    arch: str = "qwen3",
    max_position_embeddings: int = 512,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> PreTrainedModel:
    """A randomly initialised causal LM sized by `SIZE_PRESETS[size]` for `tokenizer`.

    Args:
        tokenizer: gives the vocabulary size (`len(tokenizer)`, which counts added tokens) and the
            pad/eos/bos ids written into the model config and generation config.
        size: a key of `SIZE_PRESETS`.
        arch: "qwen3" (`Qwen3ForCausalLM`: q/k RMSNorm), "llama" (`LlamaForCausalLM`) or "gpt"
            (`rlhflab.models.gpt.GPTForCausalLM`: GPT-2 shape, learned positions, 4× GELU MLP).
        max_position_embeddings: longest sequence (tokens) the model is meant for (RoPE).
        seed: `torch.manual_seed(seed)` before initialisation; the same seed gives the same weights.
        tie_word_embeddings: share the input embedding and the output projection.

    Returns:
        A float32 model in train mode on CPU, `attn_implementation="sdpa"`, head_dim =
        hidden_size / num_attention_heads.

    Raises:
        ConfigError: unknown `size` (names `model.size`) or `arch` (names `model.arch`).
    """
    if size not in SIZE_PRESETS:
        raise ConfigError(
            f"model.size: unknown size {size!r}; choose one of {', '.join(SIZE_PRESETS)}"
        )
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"model.arch: unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}"
        )
    preset = SIZE_PRESETS[size]
    config_cls, model_cls = ARCHITECTURES[arch]
    shape = dict(preset)
    if arch == "gpt":  # multi-head attention (no kv-head grouping), MLP fixed at 4 × hidden
        shape = {k: preset[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")}
    else:
        shape["head_dim"] = preset["hidden_size"] // preset["num_attention_heads"]
    config = config_cls(
        vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **shape,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def save_pretrained(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    path: str | os.PathLike[str],
    state_dict: dict | None = None,
) -> None:
    """Write `model` (safetensors, config, generation config), `tokenizer` and a model card
    (README.md, `write_model_card`) to directory `path`.

    The directory is created if needed and loads back with `rlhflab.models.load_model` /
    `load_tokenizer` or plain `AutoModelForCausalLM.from_pretrained` (for the from-scratch GPT,
    after `import rlhflab`). `state_dict` replaces the model's own (a full state gathered from
    sharded parameters).
    """
    os.makedirs(path, exist_ok=True)
    # safetensors is the default (and only format in v5)
    model.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)
    write_model_card(path, model.config, auto_class="AutoModelForCausalLM")
    match_umask(path)  # safetensors writes its files 0600 whatever the umask


def write_model_card(
    path: str | os.PathLike[str],
    config,
    *,
    auto_class: str,
    training: dict[str, str] | None = None,
    tags: list[str] | tuple[str, ...] = (),
    base_model: str | None = None,
) -> None:
    """Write `<path>/README.md`: what the directory holds and how to load it with plain
    transformers (`auto_class`, e.g. "AutoModelForCausalLM"). For rlhflab's own GPT
    (`model_type` "rlhflab_gpt") it says that `import rlhflab` must come first: that import
    registers the architecture with transformers' Auto classes (`rlhflab._autoregister`).

    training: {field: text} of the run that trained it (`rlhflab.models.card.card_fields`),
    written as a "Training" list before the loading section; tags: added after "rlhflab" in
    the YAML header; base_model: a Hub id for the header's `base_model` (as TRL's cards)."""
    from rlhflab import __version__

    model_type = getattr(config, "model_type", "?")
    arch = ", ".join(getattr(config, "architectures", None) or []) or model_type
    lines = ["---", "library_name: transformers"]
    if base_model:
        lines.append(f"base_model: {base_model}")
    lines += [
        f"tags: [{', '.join(['rlhflab', *tags])}]",
        "---",
        "",
        f"# {arch} saved by rlhflab {__version__}",
        "",
    ]
    if training:
        lines += ["## Training", ""]
        lines += [f"- **{k}**: {v}" for k, v in training.items()]
        lines += ["", "## Loading", ""]
    load = [
        "```python",
        f"from transformers import AutoTokenizer, {auto_class}",
        "",
        f'model = {auto_class}.from_pretrained("path/to/this/dir")',
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/dir")',
        "```",
    ]
    if model_type == GPTConfig.model_type:
        lines += [
            "rlhflab's from-scratch GPT (`model.build.arch: gpt`, `model_type` "
            f'"{GPTConfig.model_type}"). transformers does not know this architecture: '
            "**`import rlhflab` before loading it** (the import registers it with "
            "transformers' Auto classes; rlhflab must be installed). Without it, transformers "
            f"says it does not recognise model type {GPTConfig.model_type}.",
            "",
            "```python",
            "import rlhflab  # registers the rlhflab_gpt architecture",
            *load[1:],
        ]
    else:
        lines += [f"A standard `{model_type}` model: plain transformers loads it.", "", *load]
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write("\n".join(lines) + "\n")

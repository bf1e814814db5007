"""Model shapes for `rlhflab plan`: `ModelShape` (the config.json fields that set a dense
decoder's memory, its parameter counts), the built-in shapes (published config values) and
`resolve_shape` (a built-in name or a local model directory). Stdlib only."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The shape of a dense Llama / Qwen3 decoder (the config.json fields that set its memory)."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qk_norm: bool = False  # Qwen3's per-head RMSNorm on q and k
    qkv_bias: bool = False  # Qwen2's biases on q_proj, k_proj, v_proj
    # logits = a plain nn.Linear LM head on the backbone output (`rlhflab.models.packing.can_pack`:
    # model_type in FUSED_HEAD_TYPES, no final_logit_softcapping): completion_logps then scores
    # with the fused row-chunked head (`ops.linear_selective_log_softmax`), no (B, T+1, V) logits
    fused_head: bool = True
    # the longest sequence (prompt + completion) the model's positions cover (config.json's
    # max_position_embeddings); None: not given
    max_position_embeddings: int | None = None

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """{module name: (d_in, d_out)} of the nn.Linear layers of one decoder block."""
        h, q, k, f = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        return {
            "q_proj": (h, q),
            "k_proj": (h, k),
            "v_proj": (h, k),
            "o_proj": (q, h),
            "gate_proj": (h, f),
            "up_proj": (h, f),
            "down_proj": (f, h),
        }

    def layer_params(self) -> int:
        """Parameters of one decoder block: its linears, two RMSNorms, Qwen3's q/k norms,
        Qwen2's q/k/v biases."""
        lin = sum(i * o for i, o in self.linear_dims().values())
        bias = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        return lin + bias + 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    def embedding_params(self) -> int:
        """V·h, and 2·V·h when the LM head is not tied to the embedding."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def params(self) -> int:
        """Distinct parameters (tied weights once): layers, embeddings, final norm."""
        return (
            self.num_hidden_layers * self.layer_params()
            + self.embedding_params()
            + self.hidden_size
        )

    def backbone_params(self) -> int:
        """Parameters without an untied LM head (the critic's / a reward model's backbone)."""
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.params() - head

    def linear_params(self) -> int:
        """Parameters that go through nn.Linear (the blocks' linears and the LM head)."""
        lin = sum(i * o for i, o in self.linear_dims().values())
        return self.num_hidden_layers * lin + self.vocab_size * self.hidden_size

    def lora_params(self, r: int, targets: list[str] | str = "all-linear") -> int:
        """Trainable LoRA parameters: r·(d_in + d_out) per adapted linear of every block."""
        return self.num_hidden_layers * r * sum(i + o for i, o in self._adapted(targets))

    def _names(self, targets: list[str] | str) -> list[str]:
        """The block linears that `targets` (module-name suffixes or "all-linear") adapt."""
        dims = self.linear_dims()
        if targets == "all-linear":
            return list(dims)
        return [n for n in dims if any(n == t or n.endswith(t) for t in targets)]

    def _adapted(self, targets: list[str] | str) -> list[tuple[int, int]]:
        dims = self.linear_dims()
        return [dims[n] for n in self._names(targets)]


#: `rlhflab.models.packing.PACKABLE` (kept equal by tests/test_plan.py; this package is stdlib only).
FUSED_HEAD_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "rlhflab_gpt"})


def _qwen3(name, h, layers, f, heads, kv, vocab, tied) -> ModelShape:
    return ModelShape(name, h, layers, f, heads, kv, 128, vocab, tied, qk_norm=True,
                      max_position_embeddings=40960)  # fmt: skip


def _qwen2(name, h, layers, f, heads, kv, vocab, tied) -> ModelShape:
    return ModelShape(name, h, layers, f, heads, kv, h // heads, vocab, tied, qkv_bias=True,
                      max_position_embeddings=32768)  # fmt: skip


def _llama(name, h, layers, f, heads, kv, head_dim, vocab, tied) -> ModelShape:
    return ModelShape(name, h, layers, f, heads, kv, head_dim, vocab, tied,
                      max_position_embeddings=131072)  # fmt: skip


#: Published config.json values (Hugging Face model cards).
BUILTIN_SHAPES: dict[str, ModelShape] = {
    "qwen2.5-0.5b": _qwen2("qwen2.5-0.5b", 896, 24, 4864, 14, 2, 151936, True),
    "qwen2.5-0.5b-instruct": _qwen2("qwen2.5-0.5b-instruct", 896, 24, 4864, 14, 2, 151936, True),
    "qwen3-0.6b": _qwen3("qwen3-0.6b", 1024, 28, 3072, 16, 8, 151936, True),
    "qwen3-1.7b": _qwen3("qwen3-1.7b", 2048, 28, 6144, 16, 8, 151936, True),
    "qwen3-4b": _qwen3("qwen3-4b", 2560, 36, 9728, 32, 8, 151936, True),
    "qwen3-8b": _qwen3("qwen3-8b", 4096, 36, 12288, 32, 8, 151936, False),
    "llama-3.2-1b": _llama("llama-3.2-1b", 2048, 16, 8192, 32, 8, 64, 128256, True),
    "llama-3.2-3b": _llama("llama-3.2-3b", 3072, 28, 8192, 24, 8, 128, 128256, True),
    "llama-3.1-8b": _llama("llama-3.1-8b", 4096, 32, 14336, 32, 8, 128, 128256, False),
}


#: The Hugging Face Hub ids of the built-in shapes (matched case-insensitively): the shape is
#: known without reading the Hub.
HUB_IDS: dict[str, str] = {
    "Qwen/Qwen2.5-0.5B": "qwen2.5-0.5b",
    "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b-instruct",
    "Qwen/Qwen3-0.6B": "qwen3-0.6b",
    "Qwen/Qwen3-1.7B": "qwen3-1.7b",
    "Qwen/Qwen3-4B": "qwen3-4b",
    "Qwen/Qwen3-8B": "qwen3-8b",
    "meta-llama/Llama-3.2-1B": "llama-3.2-1b",
    "meta-llama/Llama-3.2-3B": "llama-3.2-3b",
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
}
_HUB_KEYS = {hub.lower(): name for hub, name in HUB_IDS.items()}


def resolve_shape(name_or_path: str, *, what: str = "--model") -> ModelShape:
    """A built-in shape by name, the shape in `<dir>/config.json` of a local model directory,
    or a built-in shape by its Hub id (`HUB_IDS`, any case: `Qwen/Qwen3-8B` → qwen3-8b; a local
    directory of that name wins).

    `what` names the option or field that gave `name_or_path` in the errors.

    Raises:
        ValueError: one line naming `what` (and the config.json): none of these, a config.json
            that is not UTF-8 JSON, a field missing or not a positive integer, or a
            mixture-of-experts model.
    """
    key = name_or_path.lower()
    if key in BUILTIN_SHAPES:
        return BUILTIN_SHAPES[key]
    path = Path(name_or_path) / "config.json"
    if not path.is_file() and key in _HUB_KEYS:
        return BUILTIN_SHAPES[_HUB_KEYS[key]]
    if not path.is_file():
        raise ValueError(
            f"{what}: {name_or_path!r} is neither a built-in shape "
            f"({', '.join(BUILTIN_SHAPES)}; or its Hub id: {', '.join(HUB_IDS)}) nor a "
            "directory with a config.json (Hub configs are not read: download the model's "
            "config.json into a directory and pass it)"
        )
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:  # a ValueError that names no file
        raise ValueError(
            f"{what}: {path} is not UTF-8 text (byte {exc.start}); config.json must be UTF-8 JSON"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc}") from None
    return shape_from_config(cfg, name=str(name_or_path), where=f"{what}: {path}")


def shape_from_config(cfg: dict, *, name: str, where: str) -> ModelShape:
    """The `ModelShape` of a transformers config (the dict of a model's config.json, or
    `PretrainedConfig.to_dict()`; a multimodal config's `text_config` is used when present).
    `where` names the source in errors (e.g. "--model: /path/config.json"). Raises ValueError
    (one line naming `where` and the field) when the config is not a JSON object, is a
    mixture-of-experts model (not planned), or a shape field is missing or not a positive
    integer."""
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else cfg
    if not isinstance(cfg, dict):
        raise ValueError(f"{where} is not a JSON object")
    if any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ValueError(f"{where}: mixture-of-experts models are not planned")

    def field(key: str, default=None) -> int:
        value = cfg.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}: '{key}' must be a positive integer, got {value!r}")
        return value

    heads = field("num_attention_heads")
    hidden = field("hidden_size")
    return ModelShape(
        name=name,
        hidden_size=hidden,
        num_hidden_layers=field("num_hidden_layers"),
        intermediate_size=field("intermediate_size"),
        num_attention_heads=heads,
        num_key_value_heads=field("num_key_value_heads", heads),
        head_dim=field("head_dim", cfg.get("head_dim") or hidden // heads),
        vocab_size=field("vocab_size"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=str(cfg.get("model_type", "")).startswith("qwen3"),
        qkv_bias=str(cfg.get("model_type", "")) == "qwen2" or bool(cfg.get("attention_bias")),
        fused_head=(
            str(cfg.get("model_type", "")) in FUSED_HEAD_TYPES
            and cfg.get("final_logit_softcapping") is None
        ),
        max_position_embeddings=(
            field("max_position_embeddings") if "max_position_embeddings" in cfg else None
        ),
    )

"""A GPT-2-style transformer written from scratch, trainable by every rlhflab trainer.

The model learners write themselves (Radford et al. 2019, "Language Models are Unsupervised
Multitask Learners"; the shape of nanoGPT): learned token and position embeddings, pre-norm blocks
of causal self-attention (PyTorch SDPA) and a GELU MLP with 4x expansion, a final LayerNorm and an
LM head tied to the token embedding. Initialisation is GPT-2's: N(0, 0.02) everywhere, and the two
projections that write into the residual stream (attention `c_proj`, MLP `c_proj`) get
N(0, 0.02 / sqrt(2 · n_layer)), so the residual stream's variance does not grow with depth.

It is registered with transformers (`model_type` "rlhflab_gpt"), so `AutoConfig`,
`AutoModelForCausalLM`, `save_pretrained` / `from_pretrained`, our sampler (KV cache through
transformers' `Cache` API) and padding-free scoring use it like a Qwen3 or Llama model. Build it
with `model.build.arch: gpt`. The contract it meets is the "bring your own model" contract of
docs/own_model.md.

Shapes: B batch, L new tokens this call, K keys (cached + new), C = hidden_size,
nh = num_attention_heads, hd = C / nh, V = vocab_size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GenerationMixin,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import find_packed_sequence_indices
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)

#: The model outputs' KV-cache field: "cache" from transformers 5.24 (where "past_key_values" is
#: a deprecated alias), "past_key_values" before.
CACHE_FIELD = (
    "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
)


class GPTConfig(PreTrainedConfig):
    """Hyperparameters of the GPT (transformers' standard attribute names, nanoGPT's in comments).

    Args:
        vocab_size: V (n_vocab).
        max_position_embeddings: longest sequence, the size of the position table (block_size).
        hidden_size: C (n_embd); must be divisible by num_attention_heads.
        num_hidden_layers: blocks (n_layer).
        num_attention_heads: heads (n_head).
        dropout: on attention weights and residual branches (0 for RL: log-probs must be exact).
        layer_norm_eps: LayerNorm epsilon.
        tie_word_embeddings: LM head weight = token embedding (GPT-2 ties them).
    """

    model_type = "rlhflab_gpt"

    def __init__(
        self,
        vocab_size: int = 1024,
        max_position_embeddings: int = 512,
        hidden_size: int = 128,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        dropout: float = 0.0,
        layer_norm_eps: float = 1e-5,
        tie_word_embeddings: bool = True,
        **kwargs,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.dropout = dropout
        self.layer_norm_eps = layer_norm_eps
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention; each query sees the keys its mask allows (causal + padding)."""

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        c, self.n_head = config.hidden_size, config.num_attention_heads
        if c % self.n_head:
            raise ValueError(
                f"hidden_size {c} is not divisible by num_attention_heads {self.n_head}"
            )
        self.layer_idx = layer_idx
        self.c_attn = nn.Linear(c, 3 * c)  # q, k, v in one matmul
        self.c_proj = nn.Linear(c, c)  # writes into the residual stream (scaled init)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, mask: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        b, n, c = x.shape  # (B, L, C)
        q, k, v = self.c_attn(x).split(c, dim=2)  # 3 × (B, L, C)
        q, k, v = (t.view(b, n, self.n_head, c // self.n_head).transpose(1, 2) for t in (q, k, v))
        # q, k, v: (B, nh, L, hd)
        if cache is not None:  # append this call's keys/values; get all K of them back
            k, v = cache.update(k, v, self.layer_idx)  # (B, nh, K, hd)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, L, hd) = softmax(q kᵀ / sqrt(hd) + mask) v
        y = y.transpose(1, 2).reshape(b, n, c)  # (B, L, C): heads side by side
        return F.dropout(self.c_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    """C → 4C → GELU → C."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.c_proj = nn.Linear(4 * config.hidden_size, config.hidden_size)  # scaled init
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, C) -> (B, L, C)
        return F.dropout(self.c_proj(F.gelu(self.c_fc(x))), self.dropout, self.training)


class Block(GradientCheckpointingLayer):
    """Pre-norm residual block: x + attn(ln(x)), then x + mlp(ln(x)). (The base class recomputes
    the block in the backward pass when gradient checkpointing is on; a plain nn.Module otherwise.)"""

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, mask, cache):  # (B, L, C) -> (B, L, C)
        x = x + self.attn(self.ln_1(x), mask, cache)
        return x + self.mlp(self.ln_2(x))


class GPTPreTrainedModel(PreTrainedModel):
    """transformers plumbing shared by the backbone and the LM: config class, GPT-2 init."""

    config_class = GPTConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["Block"]  # noqa: RUF012  (transformers reads it as a class attribute)
    _supports_sdpa = True
    supports_gradient_checkpointing = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "_residual_proj", False):  # GPT-2: 0.02 / sqrt(2 · n_layer)
                std = 0.02 / math.sqrt(2 * self.config.num_hidden_layers)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


class GPTModel(GPTPreTrainedModel):
    """The backbone: embeddings, blocks, final LayerNorm → hidden states (B, L, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)  # token embedding (V, C)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)  # (P, C)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        for block in self.h:  # the projections into the residual stream get the scaled init
            block.attn.c_proj._residual_proj = block.mlp.c_proj._residual_proj = True
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.wte = value

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, L) long
        attention_mask: torch.Tensor | None = None,  # (B, K) 0/1 padding, or (B, 1, L, K) bool
        position_ids: torch.Tensor | None = None,  # (B, L) long; default: past + 0..L-1
        # With no mask and no cache, position ids that restart (0..a-1, 0..b-1, ...) mark packed
        # sequences, which attend within themselves only, as transformers' models do.
        cache: Cache | None = None,  # transformers' KV cache, filled in place
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        b, n = input_ids.shape
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)  # < 5.24
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        cache = cache if use_cache else None
        past = cache.get_seq_length() if cache is not None else 0
        packed = None
        if position_ids is None:
            position_ids = torch.arange(past, past + n, device=input_ids.device).expand(b, n)
        elif attention_mask is None and cache is None:
            packed = find_packed_sequence_indices(position_ids.expand(b, n))  # (B, L) or None
        mask = _attention_mask(attention_mask, b, n, past, input_ids.device)  # (B, 1, L, K)
        if packed is not None:  # block-diagonal: a query sees keys of its own sequence only
            mask = mask & (packed[:, None, :, None] == packed[:, None, None, :])
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))  # (B, L, C)
        for block in self.h:
            x = block(x, mask, cache)
        return BaseModelOutputWithPast(last_hidden_state=self.ln_f(x), **{CACHE_FIELD: cache})


def _attention_mask(attention_mask, b: int, n: int, past: int, device) -> torch.Tensor:
    """(B, 1, L, K) bool, True = may attend, from a (B, K) 0/1 padding mask (or None) plus
    causality (query i sits at key position past + i), or a given 4-D bool mask as is. Every
    query may attend to itself, so a padding query is never fully masked (SDPA would give NaN)."""
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask.bool()
    k = past + n
    causal = torch.ones(n, k, dtype=torch.bool, device=device).tril(diagonal=past)  # (L, K)
    mask = causal.expand(b, 1, n, k)
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -k:].bool()  # (B, 1, L, K)
    eye = torch.zeros(n, k, dtype=torch.bool, device=device)
    eye[:, past:] = torch.eye(n, dtype=torch.bool, device=device)
    return mask | eye


class GPTForCausalLM(GPTPreTrainedModel, GenerationMixin):
    """The backbone plus an LM head tied to the token embedding: logits (B, L, V)."""

    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}  # noqa: RUF012

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.transformer = GPTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)  # (V, C)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        # transformers before 5.24 (its generate) names the cache `past_key_values`
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        out = self.transformer(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state  # (B, L, C)
        if logits_to_keep:  # only the last positions' logits (the sampler needs one)
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)  # (B, L', V)
        loss = None
        if labels is not None:  # next-token cross-entropy, -100 ignored (transformers' convention)
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        cached = {CACHE_FIELD: getattr(out, CACHE_FIELD)}
        return CausalLMOutputWithPast(loss=loss, logits=logits, **cached)


class GPTForSequenceClassification(GPTPreTrainedModel):
    """The backbone plus a linear `score` head read at each row's last non-pad token (the reward
    model's shape, as transformers' *ForSequenceClassification): logits (B, num_labels)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.transformer = GPTModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        hidden = self.transformer(input_ids, attention_mask, position_ids).last_hidden_state
        logits = self.score(hidden)  # (B, L, num_labels)
        if attention_mask is not None and attention_mask.dim() == 2:  # rightmost real token
            cols = torch.arange(input_ids.size(1), device=input_ids.device)
            last = (cols * attention_mask.long()).argmax(-1)  # (B,)
        else:
            last = torch.full((input_ids.size(0),), input_ids.size(1) - 1, device=input_ids.device)
        pooled = logits[torch.arange(input_ids.size(0), device=input_ids.device), last]
        return SequenceClassifierOutputWithPast(logits=pooled)


AutoConfig.register(GPTConfig.model_type, GPTConfig, exist_ok=True)
AutoModelForCausalLM.register(GPTConfig, GPTForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(GPTConfig, GPTForSequenceClassification, exist_ok=True)

"""Reward models: a causal-LM backbone plus a linear head, stored as a Hugging Face
`*ForSequenceClassification` model.

The model object *is* the transformers sequence-classification model (`Qwen3ForSequenceClassification`,
`LlamaForSequenceClassification`, ...), so `save_pretrained` / `AutoModelForSequenceClassification
.from_pretrained` round-trip it. rlhflab does not use that class's own pooling in `forward`, which
locates the last token by searching for `pad_token_id` in `input_ids` and therefore picks the wrong
token when pad == eos and a sequence ends in eos. Instead:

    h = backbone(input_ids, attention_mask, position_ids = cumsum(mask) − 1)     (B, T, H)
    z = head(h)                                                                  (B, T, C)
    score_i = z[i, last index where attention_mask_i == 1]                       (B, C)

The last real token is found from the attention mask alone, and positions count real tokens only,
so the score does not depend on the padding side, the batch neighbours or the pad id.

Scoring the same in plain transformers. `*ForSequenceClassification.forward` pools at the last
token that is not `config.pad_token_id`. With pad == eos (what `load_tokenizer` sets for tokenizers
without a pad token: the Llama and SmolLM families) a sequence ending in eos is pooled one token
early, so the saved RM scores differently there than in rlhflab. We cannot change transformers'
pooling without custom model code (`trust_remote_code`), and pooling like transformers in rlhflab
would make the score of a completion depend on whether it ends in eos. So a reward model gets a
pad token of its own (`ensure_distinct_pad`): a new special token `<|pad|>` that never occurs in
text, its embedding row zero (it is only ever read at padded positions, which the mask hides).
Then both poolings pick the same token, in a single sequence and in a padded batch, and
`AutoModelForSequenceClassification.from_pretrained(dir)` with the saved tokenizer scores as
rlhflab does. The RM trainer does this before training, so step checkpoints and the final model
agree; `save_reward_model` does it for a model built elsewhere.

Heads: C = 1 for a preference RM and ORM (a logit of P(correct)), C = 2 or 3 for a PRM (classes at
step separators, see `rlhflab.losses.reward_model`).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForSequenceClassification, PreTrainedModel

from rlhflab.errors import ModelError
from rlhflab.ops import position_ids_from_mask, upcast


def reward_head(model: PreTrainedModel) -> torch.nn.Linear:
    """The linear head of a sequence-classification model (`score` or `classifier`)."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
    raise ModelError(f"{type(model).__name__} has no linear `score`/`classifier` head")


def reward_model_from_causal_lm(
    causal_lm: PreTrainedModel,
    *,
    num_labels: int = 1,
    seed: int = 0,
    pad_token_id: int | None = None,
) -> PreTrainedModel:
    """A sequence-classification model with `causal_lm`'s backbone weights and a fresh head.

    The head is initialised N(0, 1/(H + 1)) (as TRL's RewardTrainer / OpenAI's lm-human-preferences)
    with `torch.manual_seed(seed)`. The LM head of `causal_lm` is dropped. A `causal_lm` on the
    meta device (an FSDP2 rank other than 0, `rlhflab.distributed.loads_from_rank0`) gives a
    reward model on the meta device: nothing is allocated, `distributed.wrap` fills it.

    Raises:
        ModelError: transformers has no sequence-classification class for this architecture.
    """
    config = causal_lm.config.__class__.from_dict(causal_lm.config.to_dict())
    config.num_labels = num_labels
    config.architectures = None
    if pad_token_id is not None:
        config.pad_token_id = pad_token_id
    if num_labels == 1:
        config.problem_type = "regression"
    meta = next(causal_lm.parameters()).is_meta  # an FSDP2 rank > 0: weights come from rank 0
    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            rm = AutoModelForSequenceClassification.from_config(config)
    except Exception as exc:
        raise ModelError(
            f"no sequence-classification model for '{config.model_type}': {exc}"
        ) from exc
    missing, _unexpected = rm.base_model.load_state_dict(
        causal_lm.base_model.state_dict(), strict=False
    )
    if missing:
        raise ModelError(f"backbone weights missing when building the reward model: {missing[:3]}")
    head = reward_head(rm)
    torch.manual_seed(seed)
    torch.nn.init.normal_(head.weight, std=1.0 / math.sqrt(config.hidden_size + 1))
    if head.bias is not None:
        torch.nn.init.zeros_(head.bias)
    dtype = next(causal_lm.parameters()).dtype
    rm = rm.to(device=next(causal_lm.parameters()).device, dtype=dtype)
    if dtype == torch.float64:  # its norms too (a fresh module, not the LM's)
        from rlhflab.models.loading import float64_exact

        rm = float64_exact(rm)
    return rm


#: The pad token added to a reward model's tokenizer whose pad is its eos (`ensure_distinct_pad`).
RM_PAD_TOKEN = "<|pad|>"


def ensure_distinct_pad(model: PreTrainedModel, tokenizer) -> bool:
    """Give `tokenizer` and the reward model `model` a pad token distinct from eos, when they
    have none: so transformers' own pooling (last token that is not `config.pad_token_id`) picks
    the same token as rlhflab's (last attended token), also for sequences ending in eos.

    A new special token (`RM_PAD_TOKEN`, or `<|rlhflab_pad|>` if the vocabulary already holds
    that string as a text token) is added to the tokenizer; when its id is beyond the embedding
    matrix, the embeddings grow by the rows needed, new rows zero (deterministic, no RNG drawn).
    `config.pad_token_id` is set to it. Existing token ids and every score are unchanged.
    Mutates both in place. Returns True when something changed (False: pad already distinct).

    Raises:
        ModelError: the tokenizer has no eos token and no pad token.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if pad is not None and pad != eos:
        model.config.pad_token_id = pad
        return False
    if eos is None:
        raise ModelError("reward model tokenizer: has neither a pad token nor an eos token")
    name = RM_PAD_TOKEN if RM_PAD_TOKEN not in tokenizer.get_vocab() else "<|rlhflab_pad|>"
    tokenizer.add_special_tokens({"pad_token": name})
    pad = tokenizer.pad_token_id
    emb = model.get_input_embeddings()
    rows = emb.weight.size(0)
    if pad >= rows:
        with torch.random.fork_rng(devices=[]):  # resize initialises rows: keep RNG streams
            model.resize_token_embeddings(pad + 1, mean_resizing=False)
        with torch.no_grad():
            model.get_input_embeddings().weight[rows:] = 0
    model.config.pad_token_id = pad
    return True


def load_reward_model(
    name_or_path: str,
    *,
    num_labels: int = 1,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> PreTrainedModel:
    """Load a reward model, or make one from a causal LM checkpoint.

    A checkpoint saved as `*ForSequenceClassification` loads as is (its `num_labels` wins and must
    equal `num_labels`); a causal LM checkpoint gets a fresh head (`reward_model_from_causal_lm`).

    Raises:
        ModelError: path missing / unloadable / head size mismatch.
    """
    from rlhflab.models.loading import DTYPES, float64_exact, load_model

    if os.path.isdir(name_or_path):
        try:
            config = AutoConfig.from_pretrained(name_or_path)
        except Exception as exc:
            raise ModelError(f"cannot read the config of '{name_or_path}': {exc}") from exc
        archs = config.architectures or []
        if any(a.endswith("ForSequenceClassification") for a in archs):
            if config.num_labels != num_labels:
                raise ModelError(
                    f"reward model '{name_or_path}' has {config.num_labels} labels, "
                    f"expected {num_labels}"
                )
            try:
                rm = AutoModelForSequenceClassification.from_pretrained(
                    name_or_path, dtype=DTYPES[dtype]
                )
            except Exception as exc:
                raise ModelError(f"cannot load reward model '{name_or_path}': {exc}") from exc
            if dtype == "float64":
                rm = float64_exact(rm)
            return rm.to(device)
    lm = load_model(name_or_path, dtype=dtype, device=device)
    return reward_model_from_causal_lm(
        lm, num_labels=num_labels, seed=seed, pad_token_id=lm.config.pad_token_id
    )


def last_token_index(attention_mask: Tensor) -> Tensor:
    """(B,) index of the last position whose mask is 1 (works for left and right padding)."""
    t = attention_mask.size(1)
    positions = torch.arange(t, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), positions, torch.full_like(positions, -1)).amax(-1)


def token_logits(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    autocast_dtype: torch.dtype | None = None,
) -> Tensor:
    """Head logits at every position: (B, T, C) float32, with position ids from the mask."""
    autocast = torch.autocast(
        input_ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None
    )
    with autocast:
        out = model.base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        logits = reward_head(model)(out.last_hidden_state)
    return upcast(logits)


def final_token_scores(
    model: PreTrainedModel,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    autocast_dtype: torch.dtype | None = None,
) -> Tensor:
    """Head output at the last real token: (B,) when C == 1, else (B, C). float32, with gradients."""
    logits = token_logits(model, input_ids, attention_mask, autocast_dtype=autocast_dtype)
    idx = last_token_index(attention_mask)
    out = logits[torch.arange(logits.size(0), device=logits.device), idx]  # (B, C)
    return out.squeeze(-1) if out.size(-1) == 1 else out


def score_rollout(model: PreTrainedModel, rollout, *, autocast_dtype=None) -> Tensor:
    """Scalar reward of each [prompt; completion] of a `Rollout` at its last real token (B,).

    Rows of uneven length are packed padding-free (`rlhflab.models.packing.layout_for`: prompts
    shared on CPU, varlen rows under FSDP2, whose RM is sharded as a backbone and a head, each
    called on its own): the same scores up to float rounding, without computing the padding."""
    from rlhflab import distributed
    from rlhflab.models.packing import can_pack, layout_for, packed_hidden

    device = rollout.prompt_ids.device
    if can_pack(model):
        layout = layout_for(model, rollout, sharded=distributed.is_sharded(model))
        if layout is not None:
            autocast = torch.autocast(
                device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None
            )
            hidden = packed_hidden(model, layout, autocast)[layout.last_rows, layout.last_cols]
            with autocast:
                out = upcast(reward_head(model)(hidden))  # (B, C)
            return out.squeeze(-1) if out.size(-1) == 1 else out
    return final_token_scores(
        model, rollout.input_ids, rollout.attention_mask, autocast_dtype=autocast_dtype
    )


def completion_token_logits(model: PreTrainedModel, rollout, *, autocast_dtype=None) -> Tensor:
    """Head logits at the rollout's completion positions: (B, T, C) float32, T = completion
    width; read only where the completion is real (padding: 0 when packed, else the padded
    forward's values).

    Position P + t holds the prediction after reading completion token t (so a separator token's
    logit is read *at* the separator). Rows of uneven length are packed padding-free as
    `score_rollout` packs them (`models.packing.token_positions`): the same values up to float
    rounding."""
    from rlhflab import distributed
    from rlhflab.models.packing import can_pack, layout_for, packed_hidden, token_positions

    if can_pack(model):
        layout = layout_for(model, rollout, sharded=distributed.is_sharded(model))
        if layout is not None:
            autocast = torch.autocast(rollout.prompt_ids.device.type, dtype=autocast_dtype,
                                      enabled=autocast_dtype is not None)  # fmt: skip
            at = token_positions(layout, tuple(rollout.completion_ids.shape))
            hidden = packed_hidden(model, layout, autocast)[at]  # (N, H)
            with autocast:
                out = upcast(reward_head(model)(hidden))  # (N, C)
            grid = out.new_zeros((*rollout.completion_ids.shape, out.size(-1)))
            return grid.index_put((layout.out_rows, layout.out_cols), out)
    logits = token_logits(
        model, rollout.input_ids, rollout.attention_mask, autocast_dtype=autocast_dtype
    )
    return logits[:, rollout.prompt_ids.size(1) :]


def save_reward_model(
    model: PreTrainedModel, tokenizer, path: str | os.PathLike[str], state_dict: dict | None = None
) -> None:
    """`save_pretrained` the model (its config names the *ForSequenceClassification class) and
    tokenizer; `AutoModelForSequenceClassification.from_pretrained(path)` reads it back and, with
    the saved tokenizer, scores as rlhflab does: a tokenizer whose pad is its eos first gets a
    pad token of its own (`ensure_distinct_pad`, which mutates model and tokenizer).
    `state_dict` replaces the model's own (a full state gathered from sharded parameters; the
    pad must then already be distinct, as the RM trainer makes it before sharding).

    Raises:
        ModelError: `state_dict` given with a tokenizer whose pad is its eos.
    """
    os.makedirs(path, exist_ok=True)
    if tokenizer is not None:
        if state_dict is not None and tokenizer.pad_token_id in (None, tokenizer.eos_token_id):
            raise ModelError(
                "save_reward_model: the tokenizer's pad is its eos; call ensure_distinct_pad "
                "before sharding the model"
            )
        ensure_distinct_pad(model, tokenizer)
    model.save_pretrained(path, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    from rlhflab.models.build import write_model_card
    from rlhflab.serialize import match_umask

    write_model_card(path, model.config, auto_class="AutoModelForSequenceClassification")
    match_umask(path)  # safetensors writes its files 0600 whatever the umask

"""Padding-free scoring: several sequences share one row, and attention never crosses them.

A `Rollout` lays a batch out as [left-padded prompt | right-padded completion]; with preference
pairs, SFT targets or RM data of uneven lengths a third or more of that grid is padding, and the
forward and backward pay for every cell. `packed_layout` removes it, in one of two layouts:

- **tree** (`share_prompts=True`; CPU, unsharded models, `sdpa` attention): each distinct
  prompt is written once, followed by the completions that continue it (a GRPO group's, the
  chosen and rejected side of a pair), so rows that share a prompt no longer each pay for it.
  Segments (at most twice the longest sequence) go into rows of at most 1, 1.5 or 2 times the
  longest segment, whichever gives the smallest grid (first-fit decreasing), with position ids
  as in the padded layout and a 4-D boolean attention mask that lets a completion token see its
  prompt and the earlier tokens of its own completion only. Padding positions of a packed row
  attend to themselves only.
- **varlen** (`share_prompts=False`; FSDP2-sharded models, other devices, flash attention): each
  sequence [prompt; completion] is written whole and contiguous, its position ids restarting at
  0, and no mask is passed: transformers reads the sequence boundaries from the position ids
  (`masking_utils.find_packed_sequence_indices` builds the block-causal mask for `sdpa` and
  `eager`; `flash_attention_2/3` turn them into `cu_seqlens` and run the varlen kernel, which
  needs all sequences in one row, so flash layouts are a single row). The padding at a row's
  end is a sequence of its own (positions from 0), which no real token attends to. Rows are
  chosen as in the tree layout (rows of one sequence each when nothing is shared).

Either way the model computes the same hidden states for every real token as in the padded
layout (up to float rounding); only the padding (and in the tree layout the repeated prompts)
is gone. Only decoder-only models whose logits are `lm_head(final hidden state)` are packed (the
architectures in `PACKABLE`), with an attention implementation in `PACKED_ATTENTION`; anything
else keeps the padded layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: model_type values whose causal-LM logits are a plain linear head on the backbone output and
#: whose attention takes a custom 4-D mask and explicit position ids.
PACKABLE = frozenset({"llama", "qwen2", "qwen3", "mistral", "rlhflab_gpt"})

#: Attention implementations whose packed masks are checked (tests/rollout/test_packing.py): the
#: tree layout's 4-D boolean mask is applied as given by `sdpa` only (transformers' `eager` adds
#: a 4-D mask to the scores, so a boolean one would be wrong: 0.27 nats off on the tiny model);
#: the varlen layout's boundaries are read from the position ids by `sdpa`, `eager` and the
#: flash kernels (one row). Others stay padded.
TREE_ATTENTION = frozenset({"sdpa"})
FLASH_ATTENTION = frozenset({"flash_attention_2", "flash_attention_3"})
PACKED_ATTENTION = TREE_ATTENTION | FLASH_ATTENTION | {"eager"}

#: Pack only when it removes at least this fraction of the grid (else the padded layout is as
#: cheap and its kernels see a plain causal mask).
MIN_SAVING = 0.15


@dataclass
class PackedLayout:
    """Rows packed without padding (R rows of width W) and where each prediction and each
    sequence's last token land in them; N is the number of real completion tokens."""

    input_ids: Tensor  # (R, W) long
    position_ids: Tensor  # (R, W) long
    attention_mask: Tensor | None  # (R, 1, W, W) bool, True = may attend; None: varlen
    pred_rows: Tensor  # (N,) packed row of each completion-token prediction
    pred_cols: Tensor  # (N,) packed column whose logits predict that token
    out_rows: Tensor  # (N,) row of that token in the rollout's (B, T) completion grid
    out_cols: Tensor  # (N,) column in the (B, T) grid
    last_rows: Tensor  # (B,) packed row of each sequence's last real token
    last_cols: Tensor  # (B,) packed column of that token

    def prediction_index(self, sel: Tensor) -> tuple[Tensor, Tensor]:
        """Packed (rows, cols) whose hidden states predict the completion tokens where the
        (B, T) bool `sel` is True, in `sel.nonzero()` order (row-major), as `hidden[:, :-1][sel]`
        orders them in the padded layout. `sel` must lie within the scored tokens."""
        B, T = sel.shape
        at = torch.full((B, T), -1, dtype=torch.long, device=sel.device)
        at[self.out_rows, self.out_cols] = torch.arange(len(self.out_rows), device=sel.device)
        k = at[sel]
        if bool((k < 0).any()):
            raise ValueError("prediction_index: a selected position is not a scored token")
        return self.pred_rows[k], self.pred_cols[k]


def _packable_config(cfg) -> bool:
    return (
        getattr(cfg, "model_type", None) in PACKABLE
        and getattr(cfg, "final_logit_softcapping", None) is None
    )


def token_positions(layout: PackedLayout, shape: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Packed (rows, cols) of each scored completion token itself — where its own hidden state
    is, not the one that predicts it — in `layout.out_rows`/`out_cols` order. `shape`: the
    rollout's (B, T) completion grid. Token t of a sequence sits where token t+1 is predicted
    from; its last token at (`last_rows`, `last_cols`)."""
    B, T = shape
    n = len(layout.out_rows)
    at = torch.full((B, T + 1), -1, dtype=torch.long, device=layout.out_rows.device)
    at[layout.out_rows, layout.out_cols] = torch.arange(n, device=at.device)
    j = at[layout.out_rows, layout.out_cols + 1]  # the next token's index, -1: none
    has_next = j >= 0
    j = j.clamp(min=0)
    rows = torch.where(has_next, layout.pred_rows[j], layout.last_rows[layout.out_rows])
    cols = torch.where(has_next, layout.pred_cols[j], layout.last_cols[layout.out_rows])
    return rows, cols


def can_pack(model) -> bool:
    """True for models of a PACKABLE architecture with a separate backbone (`base_model`)."""
    return (
        _packable_config(getattr(model, "config", None))
        and getattr(model, "base_model", model) is not model
    )


def attention_implementation(model) -> str:
    """The attention implementation transformers will run for `model` ("sdpa" when unset)."""
    cfg = getattr(model, "config", None)
    return getattr(cfg, "_attn_implementation", None) or "sdpa"


def layout_for(model, rollout, *, sharded: bool) -> PackedLayout | None:
    """The packed layout `model` scores `rollout` in, or None for the padded layout.

    None unless `can_pack(model)` and its attention implementation is in PACKED_ATTENTION. The
    tree layout (prompts shared, a 4-D mask) for an unsharded model on CPU with `sdpa`;
    otherwise the varlen layout (a sharded model is called through its own forward, whose mask
    comes from transformers; flash attention takes boundaries from position ids only), in one
    row under flash attention. None when it saves less than MIN_SAVING (one row: nothing)."""
    if not can_pack(model):
        return None
    return _choose_layout(model, rollout, sharded)


def backbone_layout(backbone, rollout, *, sharded: bool) -> PackedLayout | None:
    """`layout_for` of a bare backbone (a transformers base model of a PACKABLE architecture,
    called directly: PPO's critic, `rlhflab.models.value`), or None for the padded layout."""
    if not _packable_config(getattr(backbone, "config", None)):
        return None
    return _choose_layout(backbone, rollout, sharded)


def _choose_layout(model, rollout, sharded: bool) -> PackedLayout | None:
    impl = attention_implementation(model)
    if impl not in PACKED_ATTENTION:
        return None
    tree = impl in TREE_ATTENTION and not sharded and rollout.prompt_ids.device.type == "cpu"
    return packed_layout(rollout, share_prompts=tree, one_row=impl in FLASH_ATTENTION)


def packed_layout(
    rollout, *, pad_token_id: int = 0, share_prompts: bool = True, one_row: bool = False
) -> PackedLayout | None:
    """The packed layout of `rollout`, or None when packing would save less than MIN_SAVING.

    `share_prompts` (the tree layout): rows with the same prompt (a GRPO group, the chosen and
    rejected side of a preference pair) share one copy of it: a segment is [prompt, completion
    1, completion 2, ...] where each completion attends to the prompt and to itself, with
    positions continuing from the prompt, so every completion token sees exactly the context
    it has in the padded layout; `attention_mask` is (R, 1, W, W).
    Otherwise (varlen) every row is its own segment [prompt; completion] with positions 0..L-1,
    `attention_mask` is None and the model must read the boundaries from the position ids; with
    `one_row` every segment goes into a single row (what flash attention's varlen path needs),
    packed whenever that is smaller than the padded grid at all (no mask to pay for).
    """
    # Per row: prompt tokens, and completion tokens up to the last valid one (masked-out tokens
    # inside are scored, then zeroed by the caller's mask, as in the padded layout).
    widths = rollout.widths()
    prompt_len, comp_len = [p for p, _ in widths], [c for _, c in widths]
    B, P = rollout.prompt_ids.shape
    T = rollout.completion_ids.size(1)
    if B == 0 or min(prompt_len) == 0:
        return None
    width = 2 * max(p + c for p, c in zip(prompt_len, comp_len, strict=True))
    # Segments: rows grouped by prompt, a group split wherever a segment would exceed `width`.
    groups: dict[tuple, list[int]] = {}
    prompt_rows = rollout.prompt_ids.tolist()
    for i in range(B):
        groups.setdefault(tuple(prompt_rows[i][P - prompt_len[i] :]), []).append(i)
    segments: list[list[int]] = []  # row indices; the prompt is that of the first
    if not share_prompts:  # varlen: one sequence per segment
        groups = {(i,): [i] for i in range(B)}
    for members in groups.values():
        seg, used = [], prompt_len[members[0]]
        for i in members:
            if seg and used + comp_len[i] > width:
                segments.append(seg)
                seg, used = [], prompt_len[i]
            seg.append(i)
            used += comp_len[i]
        segments.append(seg)
    seg_len = [prompt_len[s[0]] + sum(comp_len[i] for i in s) for s in segments]
    # First-fit decreasing of the segments into rows of at most 1, 1.5 or 2 times the longest
    # segment, whichever grid (rows × widest fill) is smallest; one row for flash attention.
    longest = max(seg_len)
    bounds = [sum(seg_len)] if one_row else [longest, (3 * longest) // 2, 2 * longest]
    place, fill = min((_first_fit(seg_len, b) for b in bounds),
                      key=lambda pf: len(pf[1]) * max(pf[1]))  # fmt: skip
    width, rows = max(fill), len(fill)
    # One row (flash attention's varlen kernel) costs no mask: packed whenever it saves at all.
    if rows * width > (1.0 - (0.0 if one_row else MIN_SAVING)) * B * (P + T):
        return None
    device = rollout.prompt_ids.device
    ids = torch.full((rows, width), pad_token_id, dtype=torch.long, device=device)
    pos = torch.zeros((rows, width), dtype=torch.long, device=device)
    seg_id = torch.full((rows, width), -1, dtype=torch.long, device=device)
    branch = torch.zeros((rows, width), dtype=torch.long, device=device)  # 0: prompt
    pr, pc, orow, ocol = [], [], [], []
    lrow, lcol = [0] * B, [0] * B
    for k, members in enumerate(segments):
        r, start = place[k]
        p = prompt_len[members[0]]
        ids[r, start : start + p] = rollout.prompt_ids[members[0], P - p :]
        pos[r, start : start + p] = torch.arange(p, device=device)
        seg_id[r, start : start + seg_len[k]] = k
        at = start + p  # where the next completion begins
        for j, i in enumerate(members, start=1):
            c = comp_len[i]
            ids[r, at : at + c] = rollout.completion_ids[i, :c]
            pos[r, at : at + c] = torch.arange(p, p + c, device=device)
            branch[r, at : at + c] = j
            # o_0 is predicted by the prompt's last token, o_t (t >= 1) by o_{t-1}.
            pr.extend([r] * c)
            pc.extend([start + p - 1, *range(at, at + c - 1)][:c])
            orow.extend([i] * c)
            ocol.extend(range(c))
            lrow[i], lcol[i] = r, (at + c - 1 if c else start + p - 1)
            at += c
    if not share_prompts:
        # The padding after a row's last segment is a sequence of its own (positions from 0):
        # its first position never continues the segment before it (p + c - 1 >= 0 precedes 0).
        for r, used in enumerate(fill):
            pos[r, used:] = torch.arange(width - used, device=device)
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return PackedLayout(ids, pos, None, *map(as_long, (pr, pc, orow, ocol, lrow, lcol)))
    same = seg_id[:, :, None] == seg_id[:, None, :]  # (R, W, W): query, key
    visible = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    real = (seg_id >= 0)[:, :, None]
    eye = torch.eye(width, dtype=torch.bool, device=device)
    mask = torch.where(real, same & visible & causal, eye)[:, None]  # padding sees itself only
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return PackedLayout(ids, pos, mask, *map(as_long, (pr, pc, orow, ocol, lrow, lcol)))


def _first_fit(seg_len: list[int], bound: int) -> tuple[list[tuple[int, int]], list[int]]:
    """First-fit decreasing of segments of `seg_len` tokens into rows of at most `bound`
    (>= the longest): each segment's (row, start column), and each row's filled length."""
    fill: list[int] = []
    place: list[tuple[int, int]] = [(0, 0)] * len(seg_len)
    for k in sorted(range(len(seg_len)), key=lambda k: -seg_len[k]):
        for r, used in enumerate(fill):
            if used + seg_len[k] <= bound:
                place[k] = (r, used)
                fill[r] += seg_len[k]
                break
        else:
            place[k] = (len(fill), 0)
            fill.append(seg_len[k])
    return place, fill


def packed_hidden(model, layout: PackedLayout, autocast) -> Tensor:
    """(R, W, H) final hidden states of the packed rows, with gradients."""
    return backbone_hidden(model.base_model, layout, autocast)


def backbone_hidden(backbone, layout: PackedLayout, autocast) -> Tensor:
    """(R, W, H) final hidden states of a bare backbone (a transformers base model) on the packed
    rows, with gradients."""
    with autocast:
        out = backbone(
            input_ids=layout.input_ids,
            attention_mask=layout.attention_mask,
            position_ids=layout.position_ids,
            use_cache=False,
        )
    return out.last_hidden_state


def packed_completion_logits(model, layout: PackedLayout, autocast) -> Tensor:
    """(N, V) logits of every completion-token prediction of the layout, with gradients."""
    hidden = packed_hidden(model, layout, autocast)[layout.pred_rows, layout.pred_cols]  # (N, H)
    with autocast:
        logits = model.get_output_embeddings()(hidden)
    return logits

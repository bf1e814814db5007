"""Padding-free scoring: several sequences share one row, separated by a block-diagonal mask.

A `Rollout` lays a batch out as [left-padded prompt | right-padded completion]; with preference
pairs, SFT targets or RM data of uneven lengths a third or more of that grid is padding, and the
forward and backward pay for every cell; and rows that share a prompt (the chosen and rejected
side of a pair, a GRPO group) each pay for it again. `packed_layout` writes each distinct prompt
once, followed by the completions that continue it (segments of at most twice the longest
sequence), into rows of twice the longest segment (first-fit decreasing), with position ids as in the padded layout and a 4-D boolean
attention mask that lets a completion token see its prompt and the earlier tokens of its own
completion only. The model then computes the same hidden states for every real token as in the
padded layout (up to float rounding); only the padding and the repeated prompts are gone.
Padding positions of a packed row attend to themselves only.

Only decoder-only models whose logits are `lm_head(final hidden state)` are packed (the
architectures in `PACKABLE`); anything else keeps the padded layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: model_type values whose causal-LM logits are a plain linear head on the backbone output and
#: whose attention takes a custom 4-D mask and explicit position ids.
PACKABLE = frozenset({"llama", "qwen2", "qwen3", "mistral", "rlhflab_gpt"})

#: Pack only when it removes at least this fraction of the grid (else the padded layout is as
#: cheap and its kernels see a plain causal mask).
MIN_SAVING = 0.15


@dataclass
class PackedLayout:
    """Rows packed without padding (R rows of width W) and where each prediction and each
    sequence's last token land in them; N is the number of real completion tokens."""

    input_ids: Tensor  # (R, W) long
    position_ids: Tensor  # (R, W) long
    attention_mask: Tensor  # (R, 1, W, W) bool, True = may attend
    pred_rows: Tensor  # (N,) packed row of each completion-token prediction
    pred_cols: Tensor  # (N,) packed column whose logits predict that token
    out_rows: Tensor  # (N,) row of that token in the rollout's (B, T) completion grid
    out_cols: Tensor  # (N,) column in the (B, T) grid
    last_rows: Tensor  # (B,) packed row of each sequence's last real token
    last_cols: Tensor  # (B,) packed column of that token


def can_pack(model) -> bool:
    """True for models of a PACKABLE architecture with a separate backbone (`base_model`)."""
    cfg = getattr(model, "config", None)
    return (
        getattr(cfg, "model_type", None) in PACKABLE
        and getattr(cfg, "final_logit_softcapping", None) is None
        and getattr(model, "base_model", model) is not model
    )


def packed_layout(rollout, *, pad_token_id: int = 0) -> PackedLayout | None:
    """The packed layout of `rollout`, or None when packing would save less than MIN_SAVING.

    Rows with the same prompt (a GRPO group, the chosen and rejected side of a preference pair)
    share one copy of it: a segment is [prompt, completion 1, completion 2, ...] where each
    completion attends to the prompt and to itself, with positions continuing from the prompt,
    so every completion token sees exactly the context it has in the padded layout.
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
    # First-fit decreasing of the segments into rows of twice the longest segment.
    width = 2 * max(seg_len)
    fill: list[int] = []
    place: list[tuple[int, int]] = [(0, 0)] * len(segments)
    for k in sorted(range(len(segments)), key=lambda k: -seg_len[k]):
        for r, used in enumerate(fill):
            if used + seg_len[k] <= width:
                place[k] = (r, used)
                fill[r] += seg_len[k]
                break
        else:
            place[k] = (len(fill), 0)
            fill.append(seg_len[k])
    width, rows = max(fill), len(fill)
    if rows * width > (1.0 - MIN_SAVING) * B * (P + T):
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
    same = seg_id[:, :, None] == seg_id[:, None, :]  # (R, W, W): query, key
    visible = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    real = (seg_id >= 0)[:, :, None]
    eye = torch.eye(width, dtype=torch.bool, device=device)
    mask = torch.where(real, same & visible & causal, eye)[:, None]  # padding sees itself only
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return PackedLayout(ids, pos, mask, *map(as_long, (pr, pc, orow, ocol, lrow, lcol)))


def packed_hidden(model, layout: PackedLayout, autocast) -> Tensor:
    """(R, W, H) final hidden states of the packed rows, with gradients."""
    with autocast:
        out = model.base_model(
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

"""PPO's value model: a causal LM's backbone with a scalar head V(q, o_<t) per completion position.

Initialised from the policy (a copy of its transformer backbone and a zero head, so V = 0 at the
start) or loaded from a directory written by `ValueModel.save` (a value model, or a reward model
saved in the same layout: backbone in HF format + `value_head.safetensors`).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from rlhflab.ops import position_ids_from_mask, upcast
from rlhflab.serialize import match_umask

HEAD_FILE = "value_head.safetensors"


class ValueModel(nn.Module):
    """backbone: a transformers base model (returns last_hidden_state); head: nn.Linear(hidden, 1)."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy: nn.Module) -> ValueModel:
        """A copy of the policy's backbone (`get_decoder()`) with a fresh zero head.

        Frozen parameters are shared, not copied: with LoRA (`model.lora`) the critic is the
        policy's frozen base plus its own copy of the (initial) adapters and its own head, so the
        base weights are in memory once. A full fine-tune has nothing frozen: a full copy.
        The head is float32, float64 on a float64 policy (`model.dtype: float64`)."""
        decoder = policy.get_decoder()
        shared = {id(p): p for p in decoder.parameters() if not p.requires_grad}
        backbone = copy.deepcopy(decoder, memo=shared)
        model = cls(backbone, policy.config.hidden_size)
        first = next(policy.parameters())
        if first.dtype == torch.float64:
            model.head.to(torch.float64)  # (the backbone's norms were made float64 with it)
        return model.to(first.device)

    @classmethod
    def load(cls, path: str | os.PathLike[str], device: torch.device | str = "cpu") -> ValueModel:
        """Backbone via `AutoModel.from_pretrained(path)`, head from `value_head.safetensors`
        (a float64 backbone, saved from a float64 critic, gets a float64 head)."""
        from safetensors.torch import load_file
        from transformers import AutoModel

        from rlhflab.errors import ModelError

        head_file = Path(path) / HEAD_FILE
        if not head_file.is_file():
            raise ModelError(f"value.init_from: {path} has no {HEAD_FILE} (not a value model)")
        backbone = AutoModel.from_pretrained(path)
        model = cls(backbone, backbone.config.hidden_size)
        if next(backbone.parameters()).dtype == torch.float64:  # saved from a float64 critic
            from rlhflab.models.loading import float64_exact

            float64_exact(model)
        model.head.load_state_dict(load_file(str(head_file)))
        return model.to(device)

    def save(self, path: str | os.PathLike[str], state_dict: dict | None = None) -> None:
        """Backbone in HF format (config + safetensors) and the head in `value_head.safetensors`.

        `state_dict` (keys `backbone.*`, `head.*`) replaces the module's own: a full state
        gathered from sharded parameters."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        sd = state_dict if state_dict is not None else self.state_dict()
        part = {k: {n[len(k) + 1 :]: v for n, v in sd.items() if n.startswith(k + ".")}
                for k in ("backbone", "head")}  # fmt: skip
        self.backbone.save_pretrained(path, state_dict=part["backbone"])
        save_file({k: v.contiguous() for k, v in part["head"].items()}, Path(path) / HEAD_FILE)
        match_umask(path)  # safetensors writes its files 0600 whatever the umask

    def forward(self, rollout, autocast_dtype: torch.dtype | None = None) -> Tensor:
        """Values (B, T) float32 (float64 for a float64 model) of the states before each
        completion token, 0 on padding.

        `rollout` is a `rlhflab.rollout.sampler.Rollout` (read: input_ids, attention_mask,
        completion_ids, mask; not imported here, as `models/` sits below `rollout/`).

        V_t is read from the hidden state at position P−1+t, the one from which the policy
        predicts o_t, so V_t = V(q, o_<t), with the same attention mask and position ids as the
        sampler. Rows of uneven length are packed padding-free as the policy's log-probs are
        (`models.packing.backbone_layout`): the same values up to float rounding.
        """
        from rlhflab import distributed
        from rlhflab.models.packing import backbone_hidden, backbone_layout

        layout = backbone_layout(self.backbone, rollout, sharded=distributed.is_sharded(self))
        if layout is not None:
            autocast = torch.autocast(rollout.input_ids.device.type, dtype=autocast_dtype,
                                      enabled=autocast_dtype is not None)  # fmt: skip
            hidden = backbone_hidden(self.backbone, layout, autocast)
            hidden = hidden[layout.pred_rows, layout.pred_cols]  # (N, H)
            values = self.head(upcast(hidden)).squeeze(-1)  # (N,)
            grid = values.new_zeros(rollout.mask.shape)
            return grid.index_put((layout.out_rows, layout.out_cols), values) * rollout.mask
        attn = rollout.attention_mask
        width = rollout.completion_ids.size(1)
        ids = rollout.input_ids
        with torch.autocast(
            ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None
        ):
            hidden = self.backbone(
                input_ids=ids,
                attention_mask=attn,
                position_ids=position_ids_from_mask(attn),
                use_cache=False,
            ).last_hidden_state[:, -(width + 1) : -1]
        return self.head(upcast(hidden)).squeeze(-1) * rollout.mask

"""`pg_phases.completion_logits_map`, the logits passes of the policy-gradient update that need
more than the chosen token's log-prob (the entropy bonus with its gradient, OTB's Σπ²): in the
padded layout and packed (tree and varlen), against the definition computed from one plain
padded forward's full (B, T, V) logits, in float64."""

from __future__ import annotations

import pytest
import torch
from factories import force_layout

import rlhflab.rollout.sampler as sampler
from rlhflab.losses.advantages import sum_pi_squared
from rlhflab.ops import position_ids_from_mask
from rlhflab.trainers.pg_phases import completion_logits_map, logps_with_entropy


def _rollout():
    prompts = [[5, 6, 7, 8], [9, 10], [12], [13, 14, 15, 16, 17, 18]]
    completions = [[11, 12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22], [23], [24, 25]]
    return sampler.pack(prompts, completions, pad_token_id=0)


def _reference(model, rollout, temperature):
    """log π(o_t), H(π(·|o_<t)) and Σπ² from one padded forward's (B, T, V) logits / τ."""
    attn = rollout.attention_mask
    logits = model(input_ids=rollout.input_ids, attention_mask=attn,
                   position_ids=position_ids_from_mask(attn)).logits  # fmt: skip
    p, t = rollout.prompt_ids.size(1), rollout.completion_ids.size(1)
    z = logits[:, p - 1 : p - 1 + t].double() / temperature  # position P−1+t predicts o_t
    logp_all = torch.log_softmax(z, -1)
    logp = logp_all.gather(-1, rollout.completion_ids[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    pi2 = (logp_all.exp() ** 2).sum(-1)
    m = rollout.mask
    return logp * m, entropy * m, pi2 * m


@pytest.mark.parametrize("layout", ["padded", "tree", "varlen"])
def test_entropy_and_sum_pi_squared_equal_the_full_logits_definition(tiny_model64, monkeypatch,
                                                                      layout):  # fmt: skip
    rollout = _rollout()
    chosen = force_layout(monkeypatch, layout)  # completion_head's layout
    tau = 0.7
    want_logp, want_ent, want_pi2 = _reference(tiny_model64, rollout, tau)
    logp, ent = logps_with_entropy(tiny_model64, rollout, tau, None)
    pi2 = completion_logits_map(tiny_model64, rollout, tau, None,
                                lambda z, tokens: sum_pi_squared(z))  # fmt: skip
    assert len(chosen) == (0 if layout == "padded" else 2) and all(c is not None for c in chosen)
    for got, want in ((logp, want_logp), (ent, want_ent), (pi2, want_pi2)):
        assert got.shape == rollout.mask.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-10, atol=1e-10)
    # the entropy carries its gradient (the bonus trains it): d(Σ H)/dθ ≠ 0
    ent.sum().backward()
    grads = [p.grad for p in tiny_model64.parameters() if p.grad is not None]
    assert grads and max(g.abs().max().item() for g in grads) > 0
    tiny_model64.zero_grad(set_to_none=True)

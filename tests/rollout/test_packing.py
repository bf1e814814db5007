"""Padding-free packing (rlhflab.models.packing): the same log-probs, entropies, reward scores and
gradients as the padded layout, and the layout itself.

The layouts are compared in float64 (`tiny_model64`): they add the same terms in other orders,
which in float32 moves results by ~1e-7 relative, differently with each CPU's kernels."""

import random

import pytest
import torch

import rlhflab.models.packing as packing
from rlhflab.rollout.sampler import completion_logps, pack


def _uneven(n=12, seed=0, shared=False):
    """n rows of uneven lengths; with `shared`, rows come in pairs with the same prompt."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 300) for _ in range(rng.randint(2, 12))] for _ in range(n)]
    if shared:
        prompts = [prompts[i - i % 2] for i in range(n)]
    comps = [[rng.randrange(10, 300) for _ in range(rng.randint(1, 20))] for _ in range(n)]
    return pack(prompts, comps, 0)


@pytest.mark.parametrize("shared", [False, True])
def test_layout_places_every_token_once(shared):
    ro = _uneven(shared=shared)
    lay = packing.packed_layout(ro)
    assert lay is not None
    assert lay.input_ids.numel() < ro.input_ids.numel()
    # every completion token is predicted once, from the position holding the token before it
    assert len(lay.out_rows) == int(ro.mask.sum())
    prev = torch.cat([ro.prompt_ids[:, -1:], ro.completion_ids[:, :-1]], 1)
    got = lay.input_ids[lay.pred_rows, lay.pred_cols]
    assert torch.equal(got, prev[lay.out_rows, lay.out_cols])
    p_len = ro.prompt_mask.sum(1)
    assert torch.equal(
        lay.position_ids[lay.pred_rows, lay.pred_cols] + 1, p_len[lay.out_rows] + lay.out_cols
    )
    # a token never attends to the future; shared prompts are written once
    m = lay.attention_mask[:, 0]
    assert not torch.triu(m, diagonal=1).any()
    n_real = int(ro.prompt_mask.sum() + ro.mask.sum())
    n_prompt_dupes = int(ro.prompt_mask.sum(1)[1::2].sum()) if shared else 0
    assert int((lay.attention_mask[:, 0].sum(-1) > 1).sum()) <= n_real - n_prompt_dupes


def test_no_layout_when_padding_is_small():
    distinct = pack([[5, 6, k] for k in range(7, 11)], [[8, 9]] * 4, 0)  # nothing to remove
    assert packing.packed_layout(distinct) is None
    shared = pack([[5, 6, 7]] * 4, [[8, 9]] * 4, 0)  # one prompt for four completions
    lay = packing.packed_layout(shared)
    assert lay is not None and lay.input_ids.numel() <= 2 * (3 + 4 * 2)


def _close(a, b):
    """Equal to float64 rounding: 1e4·eps relative to the larger magnitude of `b`."""
    assert a.dtype == b.dtype == torch.float64
    atol = 1e4 * torch.finfo(torch.float64).eps * max(b.abs().max().item(), 1e-30)
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _logps_and_grads(model, ro, temperature):
    lp, ent = completion_logps(model, ro, temperature=temperature, with_entropy=True)
    (lp.sum() + (lp * lp).sum()).backward()
    grads = _grads(model)
    model.zero_grad()
    return lp.detach(), ent, grads


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("variant", ["packed_fused", "packed_shared_fused", "padded_fused"])
def test_cpu_fast_paths_equal_plain_path(tiny_model64, monkeypatch, temperature, variant):
    """Packed (with and without shared prompts) + fused head and padded + fused head against the
    plain path (full logits)."""
    import rlhflab.rollout.sampler as sampler

    ro = _uneven(shared=variant == "packed_shared_fused")
    with monkeypatch.context() as m:
        if variant == "padded_fused":
            m.setattr(sampler, "packed_layout", lambda r: None)
        lp1, e1, g1 = _logps_and_grads(tiny_model64, ro, temperature)
    monkeypatch.setattr(sampler, "can_pack", lambda model: False)
    lp0, e0, g0 = _logps_and_grads(tiny_model64, ro, temperature)
    _close(lp1, lp0)
    _close(e1, e0)
    assert (lp1 * (1 - ro.mask)).abs().max() == 0
    for a, b in zip(g1, g0, strict=True):
        _close(a, b)


def test_packed_reward_scores_equal_padded(tiny_model64, monkeypatch):
    from rlhflab.models.reward import reward_model_from_causal_lm, score_rollout

    rm = reward_model_from_causal_lm(tiny_model64, num_labels=1, seed=0, pad_token_id=0)
    ro = _uneven(seed=1, shared=True)
    s1 = score_rollout(rm, ro)
    monkeypatch.setattr(packing, "packed_layout", lambda r: None)
    s0 = score_rollout(rm, ro)
    _close(s1, s0)

"""Padding-free packing (rlhflab.models.packing): the same log-probs, entropies, reward scores and
gradients as the padded layout, in both layouts (tree: shared prompts and a 4-D mask; varlen:
boundaries in the position ids, the mask left to transformers), on every attention
implementation packing allows on a CPU, and the layouts themselves.

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


LAYOUTS = {  # name: packed_layout's keyword arguments
    "tree": {"share_prompts": True},
    "varlen": {"share_prompts": False},
    "varlen_one_row": {"share_prompts": False, "one_row": True},
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shared", [False, True])
def test_layout_places_every_token_once(shared, layout):
    ro = _uneven(shared=shared)
    lay = packing.packed_layout(ro, **LAYOUTS[layout])
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
    if layout == "tree":
        # a token never attends to the future; shared prompts are written once
        m = lay.attention_mask[:, 0]
        assert not torch.triu(m, diagonal=1).any()
        n_real = int(ro.prompt_mask.sum() + ro.mask.sum())
        n_prompt_dupes = int(ro.prompt_mask.sum(1)[1::2].sum()) if shared else 0
        assert int((lay.attention_mask[:, 0].sum(-1) > 1).sum()) <= n_real - n_prompt_dupes
        return
    # varlen: no mask; each sequence whole and contiguous, positions 0..L-1, so that the
    # position ids alone give the boundaries (a restart is any step other than +1)
    assert lay.attention_mask is None
    assert lay.input_ids.size(0) == 1 if layout == "varlen_one_row" else lay.input_ids.size(0) > 1
    starts = torch.diff(lay.position_ids, dim=1, prepend=lay.position_ids[:, :1] - 1) != 1
    for i in range(ro.mask.size(0)):  # the sequence ends at its last token and starts at 0
        r, c = lay.last_rows[i], lay.last_cols[i]
        L = int(p_len[i] + ro.mask[i].sum())
        assert lay.position_ids[r, c] == L - 1 and lay.position_ids[r, c - L + 1] == 0
        assert (starts[r, c - L + 1] or c - L + 1 == 0) and not starts[r, c - L + 2 : c + 1].any()
        p = int(p_len[i])
        want = torch.cat([ro.prompt_ids[i, ro.prompt_mask[i] > 0], ro.completion_ids[i, : L - p]])
        assert torch.equal(lay.input_ids[r, c - L + 1 : c + 1], want)


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
@pytest.mark.parametrize(
    "variant", ["tree", "tree_shared", "varlen", "varlen_shared", "varlen_one_row", "padded_fused"]
)
def test_cpu_fast_paths_equal_plain_path(tiny_model64, monkeypatch, temperature, variant):
    """Packed (tree and varlen layouts, with and without shared prompts) + fused head and padded +
    fused head against the plain path (full logits)."""
    import rlhflab.rollout.sampler as sampler

    ro = _uneven(shared=variant.endswith("_shared"))
    chosen = []

    def layout(model, rollout, *, sharded):
        if variant == "padded_fused":
            return None
        lay = packing.packed_layout(rollout, **LAYOUTS[variant.removesuffix("_shared")])
        chosen.append(lay)
        return lay

    with monkeypatch.context() as m:
        m.setattr(sampler, "layout_for", layout)
        lp1, e1, g1 = _logps_and_grads(tiny_model64, ro, temperature)
    assert all(lay is not None for lay in chosen) and len(chosen) == (variant != "padded_fused")
    monkeypatch.setattr(sampler, "can_pack", lambda model: False)
    lp0, e0, g0 = _logps_and_grads(tiny_model64, ro, temperature)
    _close(lp1, lp0)
    _close(e1, e0)
    assert (lp1 * (1 - ro.mask)).abs().max() == 0
    for a, b in zip(g1, g0, strict=True):
        _close(a, b)


def _model(tiny_tokenizer, arch, attn):
    from rlhflab.models.build import build_model
    from rlhflab.models.loading import float64_exact

    model = build_model(tiny_tokenizer, size="tiny", arch=arch, max_position_embeddings=128, seed=0)
    model = float64_exact(model)
    model.config._attn_implementation = attn
    return model


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "gpt"])
def test_each_attention_implementation_packs_without_leaking(tiny_tokenizer, arch, attn):
    """The layout `layout_for` picks for each attention implementation packing allows on a CPU
    (sdpa: tree; eager: varlen, because transformers' eager adds a 4-D mask to the scores) gives
    the padded sdpa path's log-probs and gradients, and a sequence's log-probs do not move when
    the tokens of the sequences packed beside it change (a mask that leaked across a boundary
    would move them). transformers' eager softmax runs in float32: 1e-6 there."""
    model = _model(tiny_tokenizer, arch, attn)
    ro = _uneven(seed=3)
    lay = packing.layout_for(model, ro, sharded=False)
    assert lay is not None
    assert (lay.attention_mask is None) == (attn == "eager")
    lp1, _, g1 = _logps_and_grads(model, ro, 1.0)
    ref = _model(tiny_tokenizer, arch, "sdpa")
    import rlhflab.rollout.sampler as sampler

    real = sampler.layout_for
    try:
        sampler.layout_for = lambda *a, **k: None
        lp0, _, g0 = _logps_and_grads(ref, ro, 1.0)
    finally:
        sampler.layout_for = real
    tol = 1e-6 if attn == "eager" and arch != "gpt" else 1e4 * torch.finfo(torch.float64).eps
    torch.testing.assert_close(lp1, lp0, atol=tol * lp0.abs().max().item(), rtol=0)
    g_max = max(g.abs().max().item() for g in g0)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, atol=tol * g_max, rtol=0)
    # change row 0's completion: every other row's log-probs stay as they were, bit for bit
    other = ro.completion_ids.clone()
    other[0] = (other[0] + 7) % 250 + 10
    ro2 = type(ro)(ro.prompt_ids, ro.prompt_mask, other, ro.mask, ro.logp, ro.truncated)
    assert packing.layout_for(model, ro2, sharded=False) is not None
    with torch.no_grad():
        a = completion_logps(model, ro)[0][1:]
        b = completion_logps(model, ro2)[0][1:]
    assert torch.equal(a, b)


def test_a_layout_without_boundaries_is_caught(tiny_tokenizer):
    """The leak check above can fail: a varlen layout whose position ids never restart (so
    transformers sees one long sequence per row) moves the log-probs of the rows packed beside
    a changed one."""
    import rlhflab.rollout.sampler as sampler

    model = _model(tiny_tokenizer, "qwen3", "sdpa")
    ro = _uneven(seed=3)

    def leaky(model, rollout, *, sharded):
        lay = packing.packed_layout(rollout, share_prompts=False)
        lay.position_ids = torch.arange(lay.input_ids.size(1)).expand_as(lay.input_ids)
        return lay

    other = ro.completion_ids.clone()
    other[0] = (other[0] + 7) % 250 + 10
    ro2 = type(ro)(ro.prompt_ids, ro.prompt_mask, other, ro.mask, ro.logp, ro.truncated)
    real = sampler.layout_for
    try:
        sampler.layout_for = leaky
        with torch.no_grad():
            a = completion_logps(model, ro)[0][1:]
            b = completion_logps(model, ro2)[0][1:]
    finally:
        sampler.layout_for = real
    assert not torch.equal(a, b)


def test_flash_attention_gets_one_varlen_row_and_others_stay_padded(tiny_model, monkeypatch):
    """Flash kernels read packed sequences from position ids in a single row (transformers'
    `_is_packed_sequence` needs batch size 1); an implementation packing does not know keeps
    the padded layout; a sharded model never gets the tree layout."""
    ro = _uneven()
    monkeypatch.setattr(tiny_model.config, "_attn_implementation", "flash_attention_2")
    lay = packing.layout_for(tiny_model, ro, sharded=False)
    assert lay.attention_mask is None and lay.input_ids.size(0) == 1
    monkeypatch.setattr(tiny_model.config, "_attn_implementation", "flex_attention")
    assert packing.layout_for(tiny_model, ro, sharded=False) is None
    monkeypatch.setattr(tiny_model.config, "_attn_implementation", "sdpa")
    assert packing.layout_for(tiny_model, ro, sharded=False).attention_mask is not None
    lay = packing.layout_for(tiny_model, ro, sharded=True)
    assert lay.attention_mask is None and lay.input_ids.size(0) > 1


@pytest.mark.parametrize("sharded", [False, True])
def test_packed_reward_scores_equal_padded(tiny_model64, monkeypatch, sharded):
    """Tree (unsharded on CPU) and varlen (sharded: is_sharded patched, one process) reward
    scores against the padded layout."""
    from rlhflab import distributed
    from rlhflab.models.reward import reward_model_from_causal_lm, score_rollout

    rm = reward_model_from_causal_lm(tiny_model64, num_labels=1, seed=0, pad_token_id=0)
    ro = _uneven(seed=1, shared=True)
    monkeypatch.setattr(distributed, "is_sharded", lambda model: sharded)
    lay = packing.layout_for(rm, ro, sharded=sharded)
    assert lay is not None and (lay.attention_mask is None) == sharded
    s1 = score_rollout(rm, ro)
    monkeypatch.setattr(packing, "packed_layout", lambda r, **kw: None)
    s0 = score_rollout(rm, ro)
    _close(s1, s0)


@pytest.mark.parametrize("sharded", [False, True])
def test_packed_token_logits_equal_padded_at_every_completion_token(tiny_model64, monkeypatch,
                                                                    sharded):  # fmt: skip
    """A PRM's per-token logits (`completion_token_logits`, read at each completion token
    itself, not at the position predicting it), tree and varlen, against the padded layout at
    every real completion token; padding reads 0 when packed."""
    from rlhflab import distributed
    from rlhflab.models.reward import completion_token_logits, reward_model_from_causal_lm

    rm = reward_model_from_causal_lm(tiny_model64, num_labels=2, seed=0, pad_token_id=0)
    ro = _uneven(seed=2, shared=True)
    monkeypatch.setattr(distributed, "is_sharded", lambda model: sharded)
    lay = packing.layout_for(rm, ro, sharded=sharded)
    assert lay is not None and (lay.attention_mask is None) == sharded
    real = ro.mask.bool()
    got = completion_token_logits(rm, ro)
    assert got.shape == (*ro.completion_ids.shape, 2) and not got[~real].any()
    monkeypatch.setattr(packing, "packed_layout", lambda r, **kw: None)
    want = completion_token_logits(rm, ro)
    _close(got[real], want[real])

"""Sampler invariances: recomputed log-probs equal sampler log-probs; padding and batch neighbours
change nothing; stopped rows dropped mid-generation give the same tokens as decoding alone.

Two computations of the same log-probs (batched vs alone, shared prefix vs not, sampler vs
trainer) are compared in float64 (`tiny_model64`): in float32 they differ by ~1e-7 relative,
differently with each CPU's kernels, and an argmax between near-equal logits could flip."""

import torch

from rlhflab.rollout.sampler import completion_logps, left_pad, pack, position_ids_from_mask, sample

PROMPTS = [[7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20], [30, 31, 32, 33, 34]]  # different lengths


def _sample(model, tok, prompts, **kw):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    kw.setdefault("max_new_tokens", 12)
    kw.setdefault("eos_token_id", tok.eos_token_id)
    return sample(model, prompts, pad_token_id=tok.pad_token_id, generator=gen, **kw)


def _close(a, b):
    """Equal to float64 rounding: 1e4·eps relative to the larger magnitude of `b`."""
    assert a.dtype == b.dtype == torch.float64
    atol = 1e4 * torch.finfo(torch.float64).eps * max(b.abs().max().item(), 1e-30)
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


def test_left_pad_and_positions():
    ids, mask = left_pad([[5, 6], [7]], pad_id=0)
    assert ids.tolist() == [[5, 6], [0, 7]]
    assert mask.tolist() == [[1, 1], [0, 1]]
    assert position_ids_from_mask(mask).tolist() == [[0, 1], [0, 0]]


def test_sampler_logp_equals_recomputed_logp(tiny_model64, tiny_tokenizer):
    tiny_model64.eval()
    ro = _sample(tiny_model64, tiny_tokenizer, PROMPTS * 2, temperature=0.7)
    with torch.no_grad():
        logp, _ = completion_logps(tiny_model64, ro, temperature=0.7)
    assert ro.mask.sum() > 0
    _close(logp, ro.logp)


def test_recomputed_logp_does_not_depend_on_batch_neighbours(tiny_model64, tiny_tokenizer):
    tiny_model64.eval()
    ro = _sample(tiny_model64, tiny_tokenizer, PROMPTS)
    with torch.no_grad():
        batched, _ = completion_logps(tiny_model64, ro)
        for i in range(len(PROMPTS)):
            comp = ro.completion_ids[i][ro.mask[i].bool()].tolist()
            alone = pack([PROMPTS[i]], [comp], tiny_tokenizer.pad_token_id)
            single, _ = completion_logps(tiny_model64, alone)
            n = len(comp)
            _close(single[0, :n], batched[i, :n])


def test_pack_reproduces_the_sampler_layout(tiny_model, tiny_tokenizer):
    tiny_model.eval()
    ro = _sample(tiny_model, tiny_tokenizer, PROMPTS)
    comps = [ro.completion_ids[i][ro.mask[i].bool()].tolist() for i in range(len(PROMPTS))]
    packed = pack(PROMPTS, comps, tiny_tokenizer.pad_token_id)
    assert torch.equal(packed.prompt_ids, ro.prompt_ids)
    assert torch.equal(packed.completion_ids, ro.completion_ids)
    assert torch.equal(packed.mask, ro.mask)


def test_stopped_rows_dropped_mid_batch_match_decoding_alone(tiny_model64, tiny_tokenizer):
    tiny_model64.eval()
    # Greedy without stopping, to find a token that prompt 0 emits at step 2; use it as EOS so
    # row 0 stops early while the others go on (and the cache is compacted).
    free = _sample(tiny_model64, tiny_tokenizer, PROMPTS, greedy=True, eos_token_id=-1)
    eos = int(free.completion_ids[0, 2])
    batched = _sample(tiny_model64, tiny_tokenizer, PROMPTS, greedy=True, eos_token_id=eos)
    assert batched.mask[0].sum() <= 3 and not batched.truncated[0]
    for i, prompt in enumerate(PROMPTS):
        alone = _sample(tiny_model64, tiny_tokenizer, [prompt], greedy=True, eos_token_id=eos)
        n = int(alone.mask[0].sum())
        assert int(batched.mask[i].sum()) == n
        assert batched.completion_ids[i, :n].tolist() == alone.completion_ids[0, :n].tolist()
        _close(batched.logp[i, :n], alone.logp[0, :n])
        assert bool(batched.truncated[i]) == bool(alone.truncated[0])


def test_truncated_flag_and_padding_after_eos(tiny_model, tiny_tokenizer):
    tiny_model.eval()
    free = _sample(
        tiny_model, tiny_tokenizer, PROMPTS, greedy=True, eos_token_id=-1, max_new_tokens=5
    )
    assert free.truncated.all() and free.mask.sum() == 5 * len(PROMPTS)
    eos = int(free.completion_ids[1, 0])
    ro = _sample(
        tiny_model, tiny_tokenizer, PROMPTS, greedy=True, eos_token_id=eos, max_new_tokens=5
    )
    assert not ro.truncated[1] and ro.mask[1].tolist()[:2] == [1.0, 0.0]
    assert (ro.completion_ids[1, 1:] == tiny_tokenizer.pad_token_id).all()
    assert (ro.logp[1, 1:] == 0).all()


def test_top_k_one_is_greedy(tiny_model, tiny_tokenizer):
    tiny_model.eval()
    greedy = _sample(tiny_model, tiny_tokenizer, PROMPTS, greedy=True, eos_token_id=-1)
    topk = _sample(tiny_model, tiny_tokenizer, PROMPTS, top_k=1, eos_token_id=-1)
    assert torch.equal(greedy.completion_ids, topk.completion_ids)
    tiny_p = _sample(tiny_model, tiny_tokenizer, PROMPTS, top_p=1e-6, eos_token_id=-1)
    assert torch.equal(greedy.completion_ids, tiny_p.completion_ids)


def test_left_pad_to_a_given_width_and_too_narrow_refused():
    ids, mask = left_pad([[5, 6], [7]], pad_id=0, width=4)
    assert ids.tolist() == [[0, 0, 5, 6], [0, 0, 0, 7]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    try:
        left_pad([[5, 6, 7]], pad_id=0, width=2)
    except ValueError as e:
        assert "width 2" in str(e) and "longest sequence 3" in str(e)
    else:
        raise AssertionError("a width shorter than the longest sequence must be refused")


def test_a_share_sampled_at_the_global_width_equals_those_rows_of_the_whole_batch(
    tiny_model64, tiny_tokenizer
):
    # What a data-parallel rank does: sample rows 2..3 of a 4-row global batch with the global
    # batch's noise rows and prompt width. Prompts 2-3 alone are narrower (5) than the batch (7).
    tiny_model64.eval()
    whole = _sample(tiny_model64, tiny_tokenizer, PROMPTS, temperature=1.0)
    width = max(len(p) for p in PROMPTS)
    share = _sample(tiny_model64, tiny_tokenizer, PROMPTS[2:], rows=[2, 3], n_rows=4, width=width)
    assert share.prompt_ids.shape == (2, width)
    assert torch.equal(share.prompt_ids, whole.prompt_ids[2:])
    n = share.completion_ids.size(1)
    assert torch.equal(share.completion_ids, whole.completion_ids[2:, :n])
    assert torch.equal(share.mask, whole.mask[2:, :n]) and not whole.mask[2:, n:].any()
    _close(share.logp, whole.logp[2:, :n])


GROUPS = [p for p in PROMPTS for _ in range(4)]  # 4 samples of each prompt, group-contiguous


def test_prefix_sharing_gives_the_unshared_tokens_and_logps(tiny_model64, tiny_tokenizer):
    tiny_model64.eval()
    for kw in ({"temperature": 0.8}, {"greedy": True}, {"top_k": 20, "top_p": 0.9}):
        shared = _sample(tiny_model64, tiny_tokenizer, GROUPS, share_prefix=True, **kw)
        alone = _sample(tiny_model64, tiny_tokenizer, GROUPS, share_prefix=False, **kw)
        assert torch.equal(shared.completion_ids, alone.completion_ids)
        assert torch.equal(shared.mask, alone.mask)
        assert torch.equal(shared.truncated, alone.truncated)
        _close(shared.logp, alone.logp)
    # duplicates that are not neighbours are shared too
    mixed = PROMPTS + PROMPTS[::-1]
    shared = _sample(tiny_model64, tiny_tokenizer, mixed, share_prefix=True)
    alone = _sample(tiny_model64, tiny_tokenizer, mixed, share_prefix=False)
    assert torch.equal(shared.completion_ids, alone.completion_ids)


def test_prefix_sharing_prefills_each_distinct_prompt_once(tiny_model, tiny_tokenizer):
    tiny_model.eval()
    widths = []
    hook = tiny_model.model.embed_tokens.register_forward_hook(
        lambda m, inp, out: widths.append(tuple(inp[0].shape))
    )
    try:
        _sample(tiny_model, tiny_tokenizer, GROUPS, max_new_tokens=3, eos_token_id=-1)
    finally:
        hook.remove()
    width = max(len(p) for p in PROMPTS)
    assert widths[0] == (len(PROMPTS), width)  # the prefill: one row per distinct prompt
    assert widths[1:] == [(len(GROUPS), 1)] * 2  # decoding: every row


def test_several_stop_ids_stop_at_the_first_and_keep_it(tiny_model, tiny_tokenizer):
    tiny_model.eval()
    free = _sample(tiny_model, tiny_tokenizer, PROMPTS, greedy=True, eos_token_id=-1)
    a, b = int(free.completion_ids[0, 3]), int(free.completion_ids[1, 1])
    ro = _sample(tiny_model, tiny_tokenizer, PROMPTS, greedy=True, eos_token_id=-1,
                 stop_token_ids=[a, b])  # fmt: skip
    for i in range(len(PROMPTS)):
        toks = free.completion_ids[i].tolist()
        stop = next((t for t, x in enumerate(toks) if x in (a, b)), None)
        n = len(toks) if stop is None else stop + 1
        assert int(ro.mask[i].sum()) == n
        assert ro.completion_ids[i, :n].tolist() == toks[:n]
        assert bool(ro.truncated[i]) == (stop is None)
    assert int(ro.mask[0].sum()) <= 4 and int(ro.mask[1].sum()) <= 2


def test_min_p_keeps_tokens_within_a_factor_of_the_top():
    from rlhflab.rollout.sampler import _filter_logits

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(_filter_logits(logits, 0, 1.0, min_p=0.25)).tolist()
    assert kept == [[True, True, True, False]]  # p >= 0.25 · 0.5 = 0.125

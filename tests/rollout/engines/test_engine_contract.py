"""The contract every rollout engine meets, checked against the `hf` engine and a trainer forward.

Parametrised over engines (conftest.py): `hf` always, `vllm` when installed.
"""

import torch

from rlhflab.rollout.engines import SamplingParams
from rlhflab.rollout.engines.hf import HFEngine
from rlhflab.rollout.sampler import completion_logps

PROMPTS = [[7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20, 21], [30, 31, 32, 33, 34]]


def _reference(model, tokenizer, engine):
    return HFEngine(
        model, pad_token_id=tokenizer.pad_token_id, stop_token_ids=engine.stop_token_ids
    )


def _rows(ro):
    """Per row: the completion's tokens (mask 1) and whether it was truncated."""
    return [
        (ro.completion_ids[i][ro.mask[i].bool()].tolist(), bool(ro.truncated[i]))
        for i in range(ro.mask.size(0))
    ]


def _check_layout(ro, pad_id, stops):
    """Right padding after the stop, mask 1 exactly on the tokens, truncated iff no stop token."""
    for i in range(ro.mask.size(0)):
        n = int(ro.mask[i].sum())
        assert ro.mask[i, :n].eq(1).all() and ro.mask[i, n:].eq(0).all()
        assert ro.completion_ids[i, n:].eq(pad_id).all() and ro.logp[i, n:].eq(0).all()
        toks = ro.completion_ids[i, :n].tolist()
        hit = [t for t, x in enumerate(toks) if x in stops]
        if ro.truncated[i]:
            assert not hit
        else:
            assert hit == [n - 1]  # stops at the first stop token, which is kept


def test_greedy_tokens_equal_the_hf_engine(engine, contract_model, tiny_tokenizer):
    params = SamplingParams(max_new_tokens=16, greedy=True)
    ro = engine.generate(PROMPTS, params)
    ref = _reference(contract_model, tiny_tokenizer, engine).generate(PROMPTS, params)
    assert _rows(ro) == _rows(ref)
    _check_layout(ro, tiny_tokenizer.pad_token_id, engine.stop_token_ids)
    with torch.no_grad():  # greedy log-probs are those of temperature 1
        logp, _ = completion_logps(contract_model, ro)
    torch.testing.assert_close(ro.logp, logp, atol=1e-4, rtol=0)


def test_sampled_logps_equal_a_trainer_forward(engine, contract_model, tiny_tokenizer):
    for temperature in (1.0, 0.7):
        params = SamplingParams(n=3, max_new_tokens=12, temperature=temperature)
        ro = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(1))
        assert ro.mask.sum() > len(PROMPTS) * 3
        _check_layout(ro, tiny_tokenizer.pad_token_id, engine.stop_token_ids)
        with torch.no_grad():
            logp, _ = completion_logps(contract_model, ro, temperature=temperature)
        torch.testing.assert_close(ro.logp, logp, atol=1e-4, rtol=0)


def test_n_per_prompt_rows_are_group_contiguous(engine, tiny_tokenizer):
    n = 4
    ro = engine.generate(PROMPTS, SamplingParams(n=n, max_new_tokens=8),
                         generator=torch.Generator().manual_seed(2))  # fmt: skip
    assert ro.completion_ids.size(0) == len(PROMPTS) * n
    for i, prompt in enumerate(PROMPTS):
        for j in range(n):
            row = ro.prompt_ids[i * n + j][ro.prompt_mask[i * n + j].bool()].tolist()
            assert row == prompt
    # the samples of a group differ (sampling, not n copies of one draw)
    firsts = {tuple(ro.completion_ids[j].tolist()) for j in range(n)}
    assert len(firsts) > 1


def test_eos_and_several_stop_ids(engine, contract_model, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    params = SamplingParams(max_new_tokens=12, greedy=True)
    free = _reference(contract_model, tiny_tokenizer, engine).generate(PROMPTS, params)
    assert _rows(free)[0] == ([eos], False)  # the contract model ends "7 8 9" with EOS
    a, b = int(free.completion_ids[1, 2]), int(free.completion_ids[3, 1])
    ro = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, greedy=True,
                                                 stop_token_ids=(a, b)))  # fmt: skip
    _check_layout(ro, tiny_tokenizer.pad_token_id, (*engine.stop_token_ids, a, b))
    for (toks, trunc), (free_toks, _) in zip(_rows(ro), _rows(free), strict=True):
        first = next((t for t, x in enumerate(free_toks) if x in (eos, a, b)), None)
        assert toks == (free_toks if first is None else free_toks[: first + 1])
        assert trunc == (first is None)
    assert _rows(ro)[0] == ([eos], False)
    assert len(_rows(ro)[1][0]) <= 3 and len(_rows(ro)[3][0]) <= 2


def test_truncation_flags(engine, tiny_tokenizer):
    ro = engine.generate(PROMPTS, SamplingParams(max_new_tokens=3, greedy=True))
    for toks, trunc in _rows(ro):
        assert trunc == (toks[-1] not in engine.stop_token_ids)
        assert len(toks) == 3 or not trunc


def test_seeds_are_reproducible(engine):
    params = SamplingParams(n=2, max_new_tokens=10)
    one = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(5))
    two = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(5))
    other = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(6))
    assert torch.equal(one.completion_ids, two.completion_ids)
    torch.testing.assert_close(one.logp, two.logp, atol=0, rtol=0)
    assert not torch.equal(one.completion_ids, other.completion_ids)
    # one draw per call from the generator, whatever the engine
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    engine.generate(PROMPTS, params, generator=g1)
    torch.randint(0, 2**62, (1,), generator=g2)
    assert torch.equal(g1.get_state(), g2.get_state())


def test_a_batch_of_more_prompt_tokens_than_one_engine_step_takes(engine, contract_model):
    # 48 prompts x 8 samples x 20 tokens = 7,680 prompt tokens, more than vLLM's default
    # 4,096-token step on CPU: a seeded request whose prefill was split over two steps crashed
    # vLLM's CPU runner ("CPU Generator does not use offset"). Every row is still a sample.
    prompts = [[(7 * i + j) % 300 + 3 for j in range(20)] for i in range(48)]
    params = SamplingParams(n=8, max_new_tokens=2)
    ro = engine.generate(prompts, params, generator=torch.Generator().manual_seed(0))
    assert ro.completion_ids.shape[0] == 48 * 8
    with torch.no_grad():
        trainer, _ = completion_logps(contract_model, ro)
    torch.testing.assert_close(ro.logp * ro.mask, trainer * ro.mask, atol=1e-4, rtol=0)


def test_rows_keep_their_completions_whatever_the_split(engine):
    """Data parallelism: a rank generating global rows [lo, hi) of a batch (`rows`, `n_rows`,
    `width` of the whole batch) gets the rows one process gets for the whole batch, with the
    same seeded generator: completions do not depend on the number of ranks."""
    n, width = 2, max(len(p) for p in PROMPTS)
    params = SamplingParams(n=n, max_new_tokens=8)
    whole = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(3))
    assert len({tuple(r[0]) for r in _rows(whole)}) > 2  # sampled: rows differ
    for lo, hi in ((0, 1), (1, 4)):  # an uneven split, as dynamic sampling's remainder gives
        part = engine.generate(
            PROMPTS[lo:hi], params, generator=torch.Generator().manual_seed(3),
            rows=list(range(lo * n, hi * n)), n_rows=len(PROMPTS) * n, width=width,
        )  # fmt: skip
        assert _rows(part) == _rows(whole)[lo * n : hi * n]
        assert torch.equal(part.prompt_ids, whole.prompt_ids[lo * n : hi * n])
        t = part.mask.size(1)
        torch.testing.assert_close(part.logp, whole.logp[lo * n : hi * n, :t], atol=1e-5, rtol=0)

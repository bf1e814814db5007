"""`rollout.half_weights`: the hf engine generates with a bf16 copy of the policy (built on the
meta device and allocated in bf16, never a full float32 copy), refreshed from the live module
before every rollout. Its completions equal sampling with the policy's own parameters cast to
bf16 (buffers such as the rotary table kept as they are), before and after a weight update."""

import copy

import pytest
import torch

from rlhflab.rollout.engines import SamplingParams
from rlhflab.rollout.engines.hf import HFEngine

PROMPTS = [[7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20], [30, 31, 32, 33, 34]]


def _cast_params(model, dtype):
    """The model with its parameters (not its buffers) cast to `dtype`: the reference."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.data = p.data.to(dtype)
    return ref


def test_half_copy_generates_what_bf16_parameters_generate_and_follows_updates(
    tiny_model, tiny_tokenizer
):
    tiny_model.eval()
    kw = dict(pad_token_id=tiny_tokenizer.pad_token_id, stop_token_ids=(tiny_tokenizer.eos_token_id,),
              autocast_dtype=torch.bfloat16)  # fmt: skip
    engine = HFEngine(tiny_model, half_weights=True, **kw)
    half = engine.half
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert sum(p.numel() for p in half.parameters()) == sum(
        p.numel() for p in tiny_model.parameters()
    )
    own = {b.data_ptr() for b in tiny_model.buffers()}
    assert all(b.data_ptr() in own for b in half.buffers())  # buffers shared, not copied
    params = SamplingParams(n=2, max_new_tokens=10, temperature=1.0)
    for update in range(2):
        if update:  # a weight update of the live policy reaches the copy at the next rollout
            with torch.no_grad():
                for p in tiny_model.parameters():
                    p.mul_(1.25)
        got = engine.generate(PROMPTS, params, generator=torch.Generator().manual_seed(4))
        ref = HFEngine(_cast_params(tiny_model, torch.bfloat16), **kw).generate(
            PROMPTS, params, generator=torch.Generator().manual_seed(4)
        )
        assert torch.equal(got.completion_ids, ref.completion_ids)
        assert torch.equal(got.mask, ref.mask)
        assert torch.equal(got.logp, ref.logp)  # the same bf16 arithmetic, bit for bit
    assert all(p.requires_grad for p in tiny_model.parameters())  # the policy is untouched


def test_half_weights_needs_a_16_bit_autocast(tiny_model, tiny_tokenizer):
    from types import SimpleNamespace

    from rlhflab.errors import ConfigError
    from rlhflab.rollout.engines import make_engine

    with pytest.raises(ValueError, match="half_weights needs a bfloat16 or float16"):
        HFEngine(tiny_model, pad_token_id=0, stop_token_ids=(1,), half_weights=True)
    cfg = SimpleNamespace(engine="hf", stop_token_ids=(), half_weights=True)
    with pytest.raises(ConfigError, match=r"rollout\.half_weights: needs a bf16 or fp16"):
        make_engine(cfg, tiny_model, tiny_tokenizer)

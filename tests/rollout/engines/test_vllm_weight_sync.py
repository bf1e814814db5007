"""Weight sync: after an optimizer step pushed with `update_weights`, the vLLM engine samples from
the updated policy (greedy tokens of the hf engine, log-probs of a trainer forward). The contract
model has tied embeddings, the case where the LM head must be reloaded as well."""

import copy

import pytest
import torch

from rlhflab.rollout.engines import SamplingParams
from rlhflab.rollout.engines.hf import HFEngine
from rlhflab.rollout.sampler import completion_logps, pack

pytestmark = pytest.mark.vllm

PROMPTS = [[7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20, 21], [30, 31, 32, 33, 34]]
GREEDY = SamplingParams(max_new_tokens=10, greedy=True)


def _tokens(ro):
    return [ro.completion_ids[i][ro.mask[i].bool()].tolist() for i in range(ro.mask.size(0))]


def test_engine_follows_the_policy_after_an_optimizer_step(vllm_engine, contract_model,
                                                          tiny_tokenizer):  # fmt: skip
    assert contract_model.config.tie_word_embeddings
    policy = copy.deepcopy(contract_model).train()
    before = vllm_engine.generate(PROMPTS, GREEDY)
    # One AdamW step towards a fixed completion: large enough to change the greedy output.
    target = pack(PROMPTS, [[40, 41, 42, 43]] * len(PROMPTS), tiny_tokenizer.pad_token_id)
    opt = torch.optim.AdamW(policy.parameters(), lr=0.05)
    logp, _ = completion_logps(policy, target)
    (-(logp * target.mask).sum()).backward()
    opt.step()
    policy.eval()
    try:
        vllm_engine.update_weights(policy.named_parameters())
        after = vllm_engine.generate(PROMPTS, GREEDY)
        ref = HFEngine(policy, pad_token_id=tiny_tokenizer.pad_token_id,
                       stop_token_ids=vllm_engine.stop_token_ids).generate(PROMPTS, GREEDY)  # fmt: skip
        assert _tokens(after) == _tokens(ref)
        assert _tokens(after) != _tokens(before)  # the step changed what is sampled
        sampled = vllm_engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8),
                                       generator=torch.Generator().manual_seed(0))  # fmt: skip
        with torch.no_grad():
            for ro in (after, sampled):
                trainer, _ = completion_logps(policy, ro)
                torch.testing.assert_close(ro.logp, trainer, atol=1e-4, rtol=0)
    finally:  # the session's engine goes back to the contract model's weights
        vllm_engine.update_weights(contract_model.named_parameters())
        restored = vllm_engine.generate(PROMPTS, GREEDY)
    assert _tokens(restored) == _tokens(before)


def test_a_push_drops_the_prefix_cache(vllm_engine, contract_model):
    """Prefix caching keeps the KV blocks of a prompt computed with the old weights; a push must
    drop them, or the same (or a block-aligned shared) prompt after it reuses stale KV. The
    session engine has 32-token blocks; a 70-token prompt fills two. Before: 2.6 nats off
    (measured with a random perturbation of 0.05 per weight); after: ~1e-6."""
    assert vllm_engine.llm.llm_engine.vllm_config.cache_config.block_size == 32
    prompt = [[(7 * j) % 200 + 10 for j in range(70)]]
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    vllm_engine.generate(prompt, greedy)  # the prompt's blocks are cached
    policy = copy.deepcopy(contract_model)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    try:
        vllm_engine.update_weights(policy.named_parameters())
        ro = vllm_engine.generate(prompt, greedy)
        with torch.no_grad():
            trainer, _ = completion_logps(policy, ro)
        torch.testing.assert_close(ro.logp, trainer, atol=1e-4, rtol=0)
    finally:
        vllm_engine.update_weights(contract_model.named_parameters())
        vllm_engine.generate(prompt, greedy)  # back to the contract model's weights

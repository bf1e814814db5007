"""KV reuse across turns (`rlhflab.rollout.kv_cache.PrefixStore`, `sample(prefix_store=...)`,
`env.kv_reuse`): a prompt that extends a finished sequence starts from that sequence's kept KV
cache, and the tokens and log-probs are those of prefilling the whole prompt (float64), while
fewer prompt tokens are forwarded."""

import pytest
import torch
from fixtures_envs import ScriptEnv

from rlhflab.envs.episodes import EpisodeLimits, run_episodes
from rlhflab.rollout.engines import SamplingParams, make_engine
from rlhflab.rollout.kv_cache import PrefixStore
from rlhflab.rollout.sampler import sample


def _kv(n: int, fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((2, n, 4), fill), torch.full((2, n, 4), -fill))]


def test_prefix_store_hands_out_the_longest_proper_prefix_once():
    store = PrefixStore()
    store.put([1, 2], _kv(2, 1.0))
    store.put([1, 2, 3], _kv(3, 2.0))
    store.put([1, 2, 3], _kv(3, 3.0))  # two sequences with the same tokens: both kept
    assert len(store) == 3
    assert store.take([1, 2, 3])[0] == 2  # a whole prompt is never a prefix of itself
    n, layers = store.take([1, 2, 3, 4])
    assert n == 3 and layers[0][0].shape == (2, 3, 4)
    assert store.take([1, 2, 3, 9])[0] == 3  # the second copy
    assert store.take([1, 2, 3, 9]) == (0, None)  # [1, 2] was taken by the first call
    assert store.take([5, 6, 7]) == (0, None) and len(store) == 0
    with pytest.raises(ValueError, match="cover exactly"):
        store.put([1, 2, 3], _kv(2, 1.0))


def _stop_ids(tokenizer) -> list[int]:
    return list(range(7, len(tokenizer), 3))  # a third of the vocabulary: turns stop early


def _continue(prompts, out, extra):
    """Each stopped row's prompt + completion + `extra[i]` (the next turn's prompt)."""
    nxt = []
    for i, p in enumerate(prompts):
        done = not bool(out.truncated[i])
        comp = [
            t
            for t, m in zip(out.completion_ids[i].tolist(), out.mask[i].tolist(), strict=True)
            if m
        ]
        if done:
            nxt.append(list(p) + comp + extra[i % len(extra)])
    return nxt


def test_kept_caches_give_the_tokens_and_logps_of_prefilling_everything(
    tiny_model64, tiny_tokenizer
):
    """Three rounds: groups sharing a prompt, then the stopped rows' histories with observations
    of different lengths and a prompt never seen; with a store and without, the same seeds."""
    model = tiny_model64.eval()
    kw = dict(max_new_tokens=8, eos_token_id=tiny_tokenizer.eos_token_id,
              pad_token_id=tiny_tokenizer.pad_token_id, stop_token_ids=_stop_ids(tiny_tokenizer))  # fmt: skip
    store, stats, plain_stats = PrefixStore(), {}, {}
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [11, 12, 13], [14]]
    reused_rounds = 0
    for rnd in range(3):
        with torch.no_grad():
            kept = sample(model, prompts, generator=torch.Generator().manual_seed(rnd),
                          prefix_store=store, stats=stats, **kw)  # fmt: skip
            plain = sample(model, prompts, generator=torch.Generator().manual_seed(rnd),
                           stats=plain_stats, **kw)  # fmt: skip
        assert torch.equal(kept.completion_ids, plain.completion_ids)
        assert torch.equal(kept.mask, plain.mask)
        torch.testing.assert_close(kept.logp, plain.logp, atol=1e-12, rtol=0)
        reused_rounds += stats.get("reused", 0) > 0
        prompts = [*_continue(prompts, kept, [[20, 21], [22], [23, 24, 25]]), [30, 31, 32]]
        assert len(prompts) >= 3, "too few rows stopped to test a continuation"
    assert reused_rounds == 2 and stats["reused"] > 0
    # every real prompt token is either forwarded or taken from a kept cache (the histories are
    # distinct, so the plain path's prefix sharing forwards each of them too)
    assert stats["prefilled"] + stats["reused"] == plain_stats["prefilled"]
    assert stats["prefilled"] < plain_stats["prefilled"]


def _episodes(model, tokenizer, kv_reuse: bool, **engine_kw):
    engine = make_engine(None, model, tokenizer)
    limits = EpisodeLimits(max_turns=3, max_turn_tokens=6, max_episode_tokens=80,
                           context_length=128, kv_reuse=kv_reuse)  # fmt: skip
    out = run_episodes(
        engine, tokenizer, ScriptEnv(), [0, 0, 1, 2, 3, 4],
        SamplingParams(n=1, stop_token_ids=tuple(_stop_ids(tokenizer))), limits,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    return out, engine.stats


def test_episodes_with_kv_reuse_equal_re_prefilling_each_turn(tiny_model64, tiny_tokenizer):
    model = tiny_model64.eval()
    with torch.no_grad():
        on, on_stats = _episodes(model, tiny_tokenizer, kv_reuse=True)
        off, off_stats = _episodes(model, tiny_tokenizer, kv_reuse=False)
    assert max(on.turns) == 3  # observations were appended between model turns
    for f in ("prompt_ids", "completion_ids", "mask", "attend", "truncated"):
        assert torch.equal(getattr(on.trajectory, f), getattr(off.trajectory, f)), f
    torch.testing.assert_close(on.trajectory.logp, off.trajectory.logp, atol=1e-12, rtol=0)
    assert on.rewards.tolist() == off.rewards.tolist()
    assert off_stats["reused"] == 0 and on_stats["reused"] > 0
    assert on_stats["prefilled"] < off_stats["prefilled"]


def test_kv_reuse_needs_the_eager_decode(tiny_model64, tiny_tokenizer):
    from rlhflab.config.policy_gradient import EnvConfig, RolloutConfig, check_sampling_modes

    with pytest.raises(ValueError, match="decode='eager'"):
        sample(tiny_model64, [[5, 6]], max_new_tokens=2, eos_token_id=0, pad_token_id=0,
               decode="static", prefix_store=PrefixStore())  # fmt: skip
    env = EnvConfig(**{"class": "x:Y"})
    with pytest.raises(ValueError, match=r"env\.kv_reuse"):
        check_sampling_modes(RolloutConfig(decode="static"), env)
    check_sampling_modes(RolloutConfig(decode="static"), env.model_copy(update={"kv_reuse": False}))
    check_sampling_modes(RolloutConfig(), env)  # eager: fine
    no_prefix_cache = RolloutConfig(engine="vllm", vllm={"enable_prefix_caching": False})
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        check_sampling_modes(no_prefix_cache, env)

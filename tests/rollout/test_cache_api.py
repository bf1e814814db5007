"""The sampler hands transformers its KV cache in the supported form: no deprecation notice about
the cache, neither a FutureWarning / DeprecationWarning (turned into errors here) nor the log line
transformers prints once per process (its `logger.warning_once`, recorded here), for every
architecture `build_model` makes and both decode loops."""

import warnings

import pytest
import torch

from rlhflab.rollout.sampler import cache_kwarg, sample

PROMPTS = [[7, 8, 9], [10, 11, 12, 13], [7, 8, 9]]  # a repeated prompt: prefix sharing on


@pytest.fixture
def cache_notices(monkeypatch):
    """Messages of transformers' once-per-process log warnings, recorded on every call (a
    `warning_once` already printed earlier in the session would otherwise go unseen)."""
    import transformers.utils.generic as generic

    seen: list[str] = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda msg, *a, **k: seen.append(msg))
    return seen


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gpt"])
def test_sampling_raises_no_cache_deprecation(arch, tiny_tokenizer, cache_notices):
    from rlhflab.models.build import build_model

    model = build_model(tiny_tokenizer, size="tiny", arch=arch, max_position_embeddings=64).eval()
    decodes = ["eager", "static"] if arch != "gpt" else ["eager"]  # gpt takes no StaticCache
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        for decode in decodes:
            ro = sample(
                model, PROMPTS, max_new_tokens=6, eos_token_id=tiny_tokenizer.eos_token_id,
                pad_token_id=tiny_tokenizer.pad_token_id, decode=decode,
                generator=torch.Generator().manual_seed(0),
            )  # fmt: skip
            assert ro.mask.sum() > 0
    assert not [m for m in cache_notices if "deprecated" in m], cache_notices


def test_cache_kwarg_follows_the_forward_signature(tiny_model):
    import inspect

    want = "cache" if "cache" in inspect.signature(tiny_model.forward).parameters else None
    assert cache_kwarg(tiny_model) == (want or "past_key_values")
    ddp_like = torch.nn.Module()
    ddp_like.module = tiny_model  # DDP keeps the model in .module; its forward takes **kwargs
    assert cache_kwarg(ddp_like) == cache_kwarg(tiny_model)

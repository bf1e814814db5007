"""Models built from presets: sizes, forward pass, seeding, config errors."""

from types import SimpleNamespace

import pytest
import torch

from rlhflab.errors import ConfigError
from rlhflab.models.build import SIZE_PRESETS, build_model, count_parameters


class _Vocab1024(SimpleNamespace):
    """Just what build_model reads from a tokenizer."""

    def __len__(self):
        return 1024


VOCAB_1024 = _Vocab1024(pad_token_id=0, eos_token_id=1, bos_token_id=None)


@pytest.mark.parametrize(
    ("size", "low", "high"),
    [
        ("tiny", 0.10e6, 0.16e6),
        ("small", 0.55e6, 0.70e6),
        ("base", 4.0e6, 4.4e6),  # the 4.2 M-parameter shape of the benchmarks
        ("medium", 12.5e6, 14.5e6),
    ],
)
def test_parameter_counts(size, low, high):
    model = build_model(VOCAB_1024, size=size)
    n = count_parameters(model)
    assert low <= n <= high, n
    cfg = model.config
    preset = SIZE_PRESETS[size]
    assert cfg.head_dim == preset["hidden_size"] // preset["num_attention_heads"]
    assert cfg.vocab_size == 1024 and cfg.tie_word_embeddings


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_forward_and_config(tiny_tokenizer, arch):
    model = build_model(tiny_tokenizer, size="tiny", arch=arch, max_position_embeddings=64)
    assert model.config.model_type == arch
    assert model.config._attn_implementation == "sdpa"
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tiny_tokenizer)
    assert model.generation_config.pad_token_id == tiny_tokenizer.pad_token_id
    assert model.generation_config.eos_token_id == tiny_tokenizer.eos_token_id
    ids = torch.randint(7, len(tiny_tokenizer), (2, 9))
    logits = model(input_ids=ids).logits
    assert logits.shape == (2, 9, len(tiny_tokenizer))
    assert torch.isfinite(logits).all()


def test_left_padding_does_not_change_logits(tiny_model64):
    """Padding shifts the positions (no position ids given: 2..5 instead of 0..3), which RoPE
    makes irrelevant up to rounding. In float64, so that the only float32 left is transformers'
    RoPE table (cos/sin of the positions, float32 whatever the model's dtype): the tolerance is
    float32 rounding of that table (16 eps32 of the logits' magnitude), not of every sum."""
    tiny_model = tiny_model64
    ids = torch.tensor([[11, 12, 13, 14]])
    ref = tiny_model(input_ids=ids).logits[0, -1]
    padded = torch.tensor([[0, 0, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    out = tiny_model(input_ids=padded, attention_mask=mask).logits[0, -1]
    assert out.dtype == torch.float64
    atol = 16 * torch.finfo(torch.float32).eps * ref.abs().max().item()
    torch.testing.assert_close(out, ref, atol=atol, rtol=0)


def test_seed_controls_init(tiny_tokenizer):
    a = build_model(tiny_tokenizer, size="tiny", seed=1).state_dict()
    b = build_model(tiny_tokenizer, size="tiny", seed=1).state_dict()
    c = build_model(tiny_tokenizer, size="tiny", seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_unknown_size_and_arch():
    with pytest.raises(
        ConfigError, match=r"^model.size: unknown size 'huge'; .*tiny, small, base, medium"
    ):
        build_model(VOCAB_1024, size="huge")
    with pytest.raises(
        ConfigError, match=r"^model.arch: unknown architecture 'gpt2'; .*qwen3, llama"
    ):
        build_model(VOCAB_1024, arch="gpt2")

"""Loading saved models/tokenizers by path, and one-line errors for what cannot be loaded."""

import json

import pytest
import torch

from rlhflab.errors import ConfigError, ModelError
from rlhflab.models.build import save_pretrained
from rlhflab.models.loading import (
    context_length,
    default_attn_implementation,
    load_model,
    load_tokenizer,
)


@pytest.fixture
def saved_dir(tiny_model, tiny_tokenizer, tmp_path):
    path = tmp_path / "ckpt"
    save_pretrained(tiny_model, tiny_tokenizer, path)
    return path


def test_round_trip_gives_identical_logits(tiny_model, tiny_tokenizer, saved_dir):
    assert (saved_dir / "model.safetensors").exists()
    model = load_model(str(saved_dir))
    tok = load_tokenizer(str(saved_dir))
    text = "<|user|>What is 3 + 4?<|end|><|assistant|><answer>7</answer>"
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert ids.tolist()[0] == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    tiny_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, tiny_model(input_ids=ids).logits, rtol=0, atol=0
        )
    assert tok.padding_side == "left" and tok.pad_token == "<|pad|>"
    assert tok.chat_template == tiny_tokenizer.chat_template
    assert model.config._attn_implementation == "sdpa"
    assert context_length(model) == 128
    assert model.generation_config.eos_token_id == tok.eos_token_id


def test_load_model_dtype(saved_dir):
    model = load_model(str(saved_dir), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ConfigError, match=r"^model.dtype: unknown dtype 'fp32'"):
        load_model(str(saved_dir), dtype="fp32")


def test_missing_path(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ModelError, match=f"^model path does not exist: {missing}$"):
        load_model(missing)
    with pytest.raises(ModelError, match=r"^model path does not exist: \./no/such/dir$"):
        load_tokenizer("./no/such/dir")


def test_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError) as info:
        load_model("rlhflab-test-org/no-such-model")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("cannot load model 'rlhflab-test-org/no-such-model': ")
    assert "not found locally and the Hugging Face Hub is offline (HF_HUB_OFFLINE=1)" in msg
    with pytest.raises(ModelError, match="cannot load tokenizer 'rlhflab-test-org/no-such-model'"):
        load_tokenizer("rlhflab-test-org/no-such-model")


def test_directory_without_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError) as info:
        load_model(str(tmp_path / "empty"))
    assert str(info.value).startswith(f"cannot load model '{tmp_path / 'empty'}': ")
    assert "\n" not in str(info.value)


def test_pad_falls_back_to_eos(saved_dir):
    cfg_path = saved_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("pad_token")
    cfg["padding_side"] = "right"
    cfg_path.write_text(json.dumps(cfg))
    tok = load_tokenizer(str(saved_dir))
    assert tok.pad_token == tok.eos_token == "<|end|>"
    assert tok.padding_side == "left"


def test_default_attention():
    assert default_attn_implementation("cpu") == "sdpa"


def test_relative_path_with_one_slash_is_a_path_when_it_exists(saved_dir, monkeypatch):
    # "org/name" looks like a Hub id; an existing local directory of that shape wins.
    monkeypatch.chdir(saved_dir.parent.parent)
    rel = f"{saved_dir.parent.name}/{saved_dir.name}"
    assert load_tokenizer(rel).eos_token == "<|end|>"


def test_float64_is_float64_end_to_end(saved_dir):
    """`model.dtype: float64` (exactness tests): parameters in float64, and the RMSNorm layers,
    which transformers computes in float32 whatever the input dtype, compute in float64 too.
    Without that a "float64" model rounds every hidden state to float32 at each norm."""
    model = load_model(str(saved_dir), dtype="float64")
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    norm = model.model.norm
    x = torch.randn(3, 5, model.config.hidden_size, dtype=torch.float64) * 3
    want = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    got = norm(x)
    assert got.dtype == torch.float64
    # float64 rounding of a mean of ~64 squares and a few products (float32 would be ~1e-7)
    tol = 1e3 * torch.finfo(torch.float64).eps * want.abs().max().item()
    torch.testing.assert_close(got, want, atol=tol, rtol=0)


def test_model_dtype_applies_to_a_built_model():
    """`model.dtype` is not ignored for `model.build` (a built model starts in float32)."""
    from fixtures_models import task_texts

    from rlhflab.config import ModelConfig
    from rlhflab.trainers.common import prepare_model

    build = {"size": "tiny", "vocab_size": 300, "max_position_embeddings": 32}
    for dtype, want in (("float64", torch.float64), ("bfloat16", torch.bfloat16)):
        cfg = ModelConfig.model_validate({"build": build, "dtype": dtype})
        _, model = prepare_model(
            cfg, device=torch.device("cpu"), seed=0, tokenizer_texts=lambda: task_texts(100)
        )
        assert {p.dtype for p in model.parameters()} == {want}, dtype

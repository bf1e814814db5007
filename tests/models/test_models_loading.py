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


def test_missing_path(tmp_path, no_hub):
    missing = str(tmp_path / "nope")
    why = "(read as a local path: it starts with '.', '~' or '/')"
    with pytest.raises(ModelError) as info:
        load_model(missing)
    assert str(info.value) == f"no such directory: {missing} {why}"
    with pytest.raises(ModelError) as info:
        load_tokenizer("./no/such/dir")
    assert str(info.value) == f"no such directory: ./no/such/dir {why}"


@pytest.fixture
def no_hub(monkeypatch):
    """Fail the test if anything asks the Hub (or transformers) for a file: a name refused as
    a local path, or a Hub id the offline cache lacks, must be refused before any look-up, so
    no download, retry or timeout can happen."""
    import huggingface_hub
    import huggingface_hub.file_download as hf_download
    import transformers.utils.hub as tf_hub

    import rlhflab.models.loading as loading

    def asked(*args, **kwargs):
        raise AssertionError(f"a Hub / from_pretrained look-up was made: {args}")

    for module, name in [(huggingface_hub, "hf_hub_download"), (hf_download, "hf_hub_download"),
                         (hf_download, "get_hf_file_metadata"), (tf_hub, "hf_hub_download"),
                         (tf_hub, "snapshot_download"), (tf_hub, "cached_files")]:  # fmt: skip
        monkeypatch.setattr(module, name, asked)
    for cls in (loading.AutoModelForCausalLM, loading.AutoTokenizer):
        monkeypatch.setattr(cls, "from_pretrained", asked)


def _online(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.mark.parametrize("online", [True, False])
def test_a_mistyped_run_path_is_refused_at_once(tmp_path, monkeypatch, no_hub, online):
    # issue 36: `model.name_or_path=runs/sftmodel` (runs/ exists, runs/sftmodel does not) was
    # looked up on the Hub: a minute of retries, then a network error
    if online:
        _online(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModelError) as info:
            load("runs/sftmodel")
        assert str(info.value) == (
            "no such directory: runs/sftmodel (read as a local path: runs/ is a local directory)"
        )


@pytest.mark.parametrize(
    "name, why",
    [
        ("sft-20261127-101010/model", "a run directory's name (<name>-<date>-<time>) is in it"),
        ("my runs/sft", "no Hub id is spelled like it"),
        ("runs/sft/model", "it has more than one '/' (a Hub id is owner/name)"),
        ("~/runs/sft", "it starts with '.', '~' or '/'"),
    ],
)
def test_names_only_a_path_can_be_are_never_looked_up(name, why, tmp_path, monkeypatch, no_hub):
    _online(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ModelError) as info:
        load_model(name)
    assert str(info.value) == f"no such directory: {name} (read as a local path: {why})"


def test_a_hub_id_not_in_the_offline_cache_is_refused_at_once(tmp_path, monkeypatch, no_hub):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModelError) as info:
            load("rlhflab-test-org/no-such-model")
        assert str(info.value) == (
            "no such directory: rlhflab-test-org/no-such-model, and no Hub model of that id in "
            "the local cache (HF_HUB_OFFLINE=1)"
        )


def test_a_hub_id_is_still_handed_to_transformers(tmp_path, monkeypatch):
    # "owner/name" with no local owner/ directory: a Hub id (cached offline, or online)
    import huggingface_hub.constants

    from rlhflab.models.loading import resolve_name_or_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "hub" / "models--Qwen--Qwen3-0.6B").mkdir(parents=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert resolve_name_or_path("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    _online(monkeypatch)
    assert resolve_name_or_path("runs/sftmodel") == "runs/sftmodel"  # no runs/ here: a Hub id
    assert resolve_name_or_path("gpt2") == "gpt2"


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

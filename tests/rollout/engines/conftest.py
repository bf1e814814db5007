"""Engines under test: `hf` always, `vllm` when `import vllm` works (its own environment: see
constraints-vllm.txt). One model for the whole session, "small" size (vLLM needs head dim >= 32),
randomly initialised with tied embeddings. Its EOS embedding is 1.05 × that of token 9, so the
greedy continuation of a prompt ending in 9 (which repeats 9) stops with EOS instead: EOS is
exercised, with a 5% logit margin that float rounding cannot flip."""

import importlib.util
import os

import pytest
import torch

from rlhflab.rollout.engines import stop_ids_for
from rlhflab.rollout.engines.hf import HFEngine

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def build_contract_model(tokenizer, seed: int = 0, tie: bool = True):
    from rlhflab.models.build import build_model

    model = build_model(
        tokenizer, size="small", max_position_embeddings=128, seed=seed, tie_word_embeddings=tie
    )
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[tokenizer.eos_token_id] = 1.05 * emb[9]
    return model.eval()


@pytest.fixture(scope="session")
def contract_model(tiny_tokenizer):
    return build_contract_model(tiny_tokenizer)


@pytest.fixture(scope="session")
def vllm_engine(contract_model, tiny_tokenizer):
    """One vLLM LLM per test session (its start-up takes 20-75 s on CPU)."""
    if not HAVE_VLLM:
        if os.environ.get("RLHFLAB_REQUIRE_VLLM"):  # CI's vllm environment: never skip silently
            pytest.fail("RLHFLAB_REQUIRE_VLLM is set but vllm is not installed")
        pytest.skip("vllm is not installed (pip install rlhflab[vllm])")
    from rlhflab.config import VLLMConfig
    from rlhflab.rollout.engines.vllm import VLLMEngine

    stops = stop_ids_for(contract_model, tiny_tokenizer)
    # KV blocks of 32 tokens (CPU default 128): prompts of the weight-sync tests fill blocks
    # that prefix caching would reuse after a push
    engine = VLLMEngine.from_model(
        contract_model, tiny_tokenizer, VLLMConfig(block_size=32), stop_token_ids=stops
    )
    yield engine
    engine.close()


@pytest.fixture(params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request, contract_model, tiny_tokenizer):
    if request.param == "hf":
        stops = stop_ids_for(contract_model, tiny_tokenizer)
        return HFEngine(
            contract_model, pad_token_id=tiny_tokenizer.pad_token_id, stop_token_ids=stops
        )
    return request.getfixturevalue("vllm_engine")

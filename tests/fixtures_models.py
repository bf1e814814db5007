"""Shared fixtures: a small tokenizer trained on task text, and a tiny model built from it.

Import the fixtures into a conftest.py to use them:
    from fixtures_models import tiny_model, tiny_model64, tiny_tokenizer  # noqa: F401
"""

import pytest

TOKENIZER_VOCAB = 400


def task_texts(n: int = 300) -> list[str]:
    """Questions and answers of two arithmetic tasks (deterministic)."""
    import reasoning_gym

    texts = []
    for name in ("chain_sum", "basic_arithmetic"):
        ds = reasoning_gym.create_dataset(name, size=n, seed=123)
        for item in ds:
            texts.append(item["question"])
            texts.append(str(item["answer"]))
    return texts


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from rlhflab.models.tokenizer import train_tokenizer

    return train_tokenizer(task_texts(), vocab_size=TOKENIZER_VOCAB)


@pytest.fixture
def tiny_model(tiny_tokenizer):
    from rlhflab.models.build import build_model

    return build_model(tiny_tokenizer, size="tiny", max_position_embeddings=128, seed=0)


@pytest.fixture
def tiny_model64(tiny_model):
    """`tiny_model` in float64, for exactness tests that compare two computations of the same
    quantity (micro-batches vs one batch, packed vs padded, cached vs recomputed): in float32
    their difference depends on the CPU kernels torch picks; in float64 it is ~1e-16 relative
    (`float64_exact`: the RMSNorm layers compute in float64 too)."""
    from rlhflab.models.loading import float64_exact

    return float64_exact(tiny_model)


@pytest.fixture(scope="module")
def policy_and_rm(tmp_path_factory):
    """A 6-step SFT policy (tests/test_checkpoint_resume.py's `sft_raw`) and an untrained reward
    model on its backbone and tokenizer: (policy directory, reward-model directory)."""
    from test_checkpoint_resume import sft_raw

    from rlhflab.config import config_from_dict
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.models.reward import reward_model_from_causal_lm, save_reward_model
    from rlhflab.trainers import run_config

    root = tmp_path_factory.mktemp("policy_and_rm")
    policy = run_config(config_from_dict(sft_raw(root, steps=6)))["model_dir"]
    rm = reward_model_from_causal_lm(load_model(policy), num_labels=1, pad_token_id=0)
    save_reward_model(rm, load_tokenizer(policy), root / "rm")
    return policy, str(root / "rm")

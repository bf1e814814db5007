"""Shared fixtures: a small tokenizer trained on task text, and a tiny model built from it.

Import the fixtures into a conftest.py to use them:
    from fixtures_models import tiny_model, tiny_tokenizer  # noqa: F401
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

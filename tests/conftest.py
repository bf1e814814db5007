"""Shared test set-up: offline, CPU, deterministic."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from fixtures_models import policy_and_rm, tiny_model, tiny_model64, tiny_tokenizer  # noqa: F401

# Tiny models gain nothing from a second thread, and one thread keeps timings stable when the
# machine is shared.
torch.set_num_threads(1)

"""Models and tokenizers: load by hub id or path, or build small ones from scratch.

* `train_tokenizer` — byte-level BPE with single-digit tokens and a chat template.
* `build_model`, `SIZE_PRESETS` — Qwen3/Llama-shaped models from 0.1 M to 13 M parameters.
* `load_model`, `load_tokenizer`, `context_length` — pretrained checkpoints, offline-friendly errors.
"""

from rlhflab.models.build import SIZE_PRESETS, build_model, count_parameters, save_pretrained
from rlhflab.models.loading import context_length, load_model, load_tokenizer
from rlhflab.models.tokenizer import CHAT_TEMPLATE, train_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "SIZE_PRESETS",
    "build_model",
    "context_length",
    "count_parameters",
    "load_model",
    "load_tokenizer",
    "save_pretrained",
    "train_tokenizer",
]

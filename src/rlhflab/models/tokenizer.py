"""A small byte-level BPE tokenizer trained locally, with a chat template.

Models trained from scratch in rlhflab use this tokenizer. Its design follows from two traps
(measured on this design):

* Digits are split one per token (`Digits(individual_digits=True)`) so arithmetic answers are
  spelled digit by digit instead of by whatever multi-digit merges BPE happened to learn.
* The prompt/completion boundary is a special token. A rendered prompt ends in `<|assistant|>`,
  which never merges with the text that follows, so tokenizing the prompt and the completion
  separately gives the same ids as tokenizing their concatenation. With ByteLevel, a prompt ending
  in a space (``"Answer: "``) would otherwise end in a dangling ``Ġ`` that merges differently.

Chat template (stored in the tokenizer, so `tokenizer.apply_chat_template` works)::

    <|system|>{content}<|end|>     (optional)
    <|user|>{content}<|end|>
    <|assistant|>{content}<|end|>
    <|assistant|>                  (add_generation_prompt=True)

`<answer>` and `</answer>` are added as single, *non-special* tokens: they survive
`decode(..., skip_special_tokens=True)`, so verifiers see them in decoded completions.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlhflab.errors import ConfigError

PAD = "<|pad|>"
EOS = "<|end|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SYSTEM = "<|system|>"
ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"

#: Special tokens, in id order (PAD is id 0, EOS id 1, ...). Skipped by `skip_special_tokens`.
SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOS, USER, ASSISTANT, SYSTEM)
#: Added, non-special single tokens (ids 5 and 6). Kept by `skip_special_tokens`.
ANSWER_TOKENS: tuple[str, ...] = (ANSWER_OPEN, ANSWER_CLOSE)

ROLES: tuple[str, ...] = ("system", "user", "assistant")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


def train_tokenizer(
    texts: Iterable[str],
    *,
    vocab_size: int = 1024,
    min_frequency: int = 2,
    model_max_length: int = 512,
    seed: int | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts` and wrap it for transformers.

    Args:
        texts: training strings (e.g. questions and answers of the task); iterated once.
        vocab_size: target vocabulary size *including* the 7 special/added tokens. The result
            has `len(tokenizer) <= vocab_size`: BPE stops early when no pair occurs
            `min_frequency` times (small corpora).
        min_frequency: minimum count for a merge.
        model_max_length: stored as `tokenizer.model_max_length` (tokens).
        seed: accepted for config symmetry only. BPE training uses no randomness: the same
            texts in the same order always give the same tokenizer, whatever the seed.

    Returns:
        A `PreTrainedTokenizerFast` (transformers 5: `TokenizersBackend`) with pad `<|pad|>` (id 0),
        eos `<|end|>` (id 1), no bos, `padding_side="left"` and `chat_template` = `CHAT_TEMPLATE`.
        Every byte is in the initial alphabet, so no string is ever out of vocabulary.

    Raises:
        ConfigError: `vocab_size` too small to hold the byte alphabet and special tokens.

    Cost: ~1 s for 60k short strings on 2 cores.
    """
    del seed  # deterministic by construction; see docstring
    n_reserved = len(SPECIAL_TOKENS) + len(ANSWER_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + n_reserved:
        raise ConfigError(
            f"tokenizer.vocab_size: {vocab_size} is too small; byte-level BPE needs at least "
            f"{len(alphabet) + n_reserved} (256 bytes + {n_reserved} special tokens)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[*SPECIAL_TOKENS, *ANSWER_TOKENS],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    from rlhflab.tracking import phase

    with phase(f"tokenizer (vocab {vocab_size})"):
        tok.train_from_iterator(texts, trainer)
    # The trainer registers every reserved token as special; mark the answer tags non-special so
    # `skip_special_tokens=True` keeps them. Round-trip through JSON so the backend's own
    # special-token set agrees with the flags.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ANSWER_TOKENS])
    tok = Tokenizer.from_str(tok.to_str())
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM],
        padding_side="left",
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )

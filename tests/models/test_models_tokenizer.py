"""The locally trained tokenizer: round trips, digit splitting, chat template, determinism."""

import pytest
from fixtures_models import TOKENIZER_VOCAB, task_texts

from rlhflab.data.formatting import encode_completion, encode_prompt, render_prompt
from rlhflab.errors import ConfigError, ModelError
from rlhflab.models.tokenizer import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    ASSISTANT,
    EOS,
    PAD,
    SYSTEM,
    USER,
    train_tokenizer,
)


def test_special_tokens_have_fixed_ids(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok.convert_tokens_to_ids([PAD, EOS, USER, ASSISTANT, SYSTEM, ANSWER_OPEN, ANSWER_CLOSE])
    assert ids == [0, 1, 2, 3, 4, 5, 6]
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, None)
    assert tok.padding_side == "left"
    assert tok.model_max_length == 512
    assert len(tok) <= TOKENIZER_VOCAB


@pytest.mark.parametrize(
    "text",
    [
        "What is 12 + 345?",
        " -5",
        "Answer: ",
        "héllo wörld 🙂\n\ttabs",
        "<answer>-17</answer>",
        "",
    ],
)
def test_round_trip(tiny_tokenizer, text):
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids) == text


def test_digits_are_single_tokens(tiny_tokenizer):
    tokens = tiny_tokenizer.tokenize("12345 + 67")
    digit_tokens = [t for t in tokens if any(c.isdigit() for c in t)]
    assert digit_tokens == ["1", "2", "3", "4", "5", "6", "7"]


def test_answer_tags_are_single_non_special_tokens(tiny_tokenizer):
    ids = tiny_tokenizer("<answer>42</answer>", add_special_tokens=False)["input_ids"]
    assert ids[0] == 5 and ids[-1] == 6 and len(ids) == 4
    # skip_special_tokens drops pad/eos/roles but keeps the answer tags for the verifier.
    text = tiny_tokenizer.decode([3, *ids, 1, 0], skip_special_tokens=True)
    assert text == "<answer>42</answer>"


def test_chat_template_prompt_ends_in_assistant_token(tiny_tokenizer):
    prompt = render_prompt(tiny_tokenizer, "What is 2 + 2?", system="Be brief.")
    assert prompt == "<|system|>Be brief.<|end|><|user|>What is 2 + 2?<|end|><|assistant|>"
    ids = encode_prompt(tiny_tokenizer, prompt)
    assert ids[-1] == tiny_tokenizer.convert_tokens_to_ids(ASSISTANT)
    assert ids[0] == tiny_tokenizer.convert_tokens_to_ids(SYSTEM)


def test_separate_encoding_equals_joint_encoding(tiny_tokenizer):
    # The boundary is a special token, so nothing merges across it.
    prompt = render_prompt(tiny_tokenizer, "Answer: ")
    for completion in [" -5", "42", "<answer>7</answer>", " 12 "]:
        joint = tiny_tokenizer(prompt + completion, add_special_tokens=False)["input_ids"]
        separate = encode_prompt(tiny_tokenizer, prompt) + encode_completion(
            tiny_tokenizer, completion
        )
        assert separate[:-1] == joint
        assert separate[-1] == tiny_tokenizer.eos_token_id


def test_full_conversation_matches_prompt_plus_completion(tiny_tokenizer):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    full = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert full == render_prompt(tiny_tokenizer, "q") + "a" + EOS


def test_unknown_role_is_rejected(tiny_tokenizer):
    from rlhflab.data.formatting import render_messages

    with pytest.raises(ModelError, match="unknown chat role: tool"):
        render_messages(tiny_tokenizer, [{"role": "tool", "content": "x"}])


def test_training_is_deterministic():
    texts = task_texts(100)
    a = train_tokenizer(texts, vocab_size=320)
    b = train_tokenizer(texts, vocab_size=320, seed=7)
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert a.get_vocab() == b.get_vocab()


def test_vocab_too_small():
    with pytest.raises(ConfigError, match=r"tokenizer.vocab_size: 100 is too small"):
        train_tokenizer(["abc"], vocab_size=100)

"""The prompt/completion boundary shared by SFT, RL, DPO and eval."""

import pytest

from rlhflab.data.formatting import (
    encode_completion,
    encode_prompt,
    format_completion,
    render_prompt,
)
from rlhflab.errors import ConfigError, ModelError


def test_render_prompt(tiny_tokenizer):
    assert render_prompt(tiny_tokenizer, "Q?") == "<|user|>Q?<|end|><|assistant|>"


def test_format_completion():
    assert format_completion("42", answer_format="tags") == "<answer>42</answer>"
    assert format_completion("42", answer_format="plain") == "42"
    assert format_completion("42", answer_format="boxed") == "\\boxed{42}"
    assert format_completion("42", answer_format="last_number") == "42"
    with pytest.raises(
        ConfigError,
        match=r"^answer_format: must be one of tags, plain, last_number, last_line, boxed, "
        r"got 'xml'$",
    ):
        format_completion("42", answer_format="xml")


def test_encode(tiny_tokenizer):
    prompt = render_prompt(tiny_tokenizer, "1 + 2 =")
    p_ids = encode_prompt(tiny_tokenizer, prompt)
    assert p_ids[0] == tiny_tokenizer.convert_tokens_to_ids("<|user|>")
    c_ids = encode_completion(tiny_tokenizer, "<answer>3</answer>")
    assert c_ids == [5, tiny_tokenizer.convert_tokens_to_ids("3"), 6, tiny_tokenizer.eos_token_id]


def test_tokenizer_without_chat_template(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = None
    with pytest.raises(ModelError, match=r"^tokenizer has no chat template"):
        render_prompt(tok, "Q?")

"""A reward model whose tokenizer pads with eos (Llama / SmolLM tokenizers after `load_tokenizer`)
scores the same in plain transformers as in rlhflab once saved: transformers pools at the last
token that is not `config.pad_token_id`, rlhflab at the last attended token."""

import copy

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhflab.models.reward import (
    RM_PAD_TOKEN,
    ensure_distinct_pad,
    final_token_scores,
    reward_model_from_causal_lm,
    save_reward_model,
)
from rlhflab.rewards.reward_model import RewardModelScorer

TEXTS = ["What is 2 + 3? Answer: 5", "Compute 17 - 4 - 1. Answer: 12"]


@pytest.fixture
def pad_is_eos(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.pad_token = tok.eos_token
    assert tok.pad_token_id == tok.eos_token_id
    return tok


@pytest.fixture
def rm(tiny_model, pad_is_eos):
    return reward_model_from_causal_lm(
        tiny_model, num_labels=1, pad_token_id=pad_is_eos.pad_token_id
    ).eval()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_the_problem_transformers_pools_before_the_final_eos(rm, pad_is_eos):
    # Without a distinct pad, transformers' score is the head at the token before eos.
    ids = torch.tensor([_ids(pad_is_eos, TEXTS[0])])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        hf = rm(input_ids=ids).logits[0, 0]
        ours = final_token_scores(rm, ids, mask)[0]
        before_eos = final_token_scores(rm, ids[:, :-1], mask[:, :-1])[0]
    assert abs(hf - ours) > 1e-3
    torch.testing.assert_close(hf, before_eos, rtol=0, atol=1e-5)


def test_saved_rm_scores_the_same_in_transformers_and_rlhflab(rm, pad_is_eos, tmp_path):
    seqs = [_ids(pad_is_eos, t) for t in TEXTS]  # both end in eos (== the old pad)
    with torch.no_grad():
        before = [final_token_scores(rm, torch.tensor([s]), torch.ones(1, len(s)))[0] for s in seqs]
    vocab = len(pad_is_eos)
    save_reward_model(rm, pad_is_eos, tmp_path / "rm")

    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "rm")
    hf_rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    # the tiny tokenizer already holds "<|pad|>" (its old pad): the fallback name is used
    assert RM_PAD_TOKEN in hf_tok.get_vocab() and hf_tok.pad_token == "<|rlhflab_pad|>"
    assert hf_tok.pad_token_id == vocab
    assert hf_rm.config.pad_token_id == vocab != hf_tok.eos_token_id
    # the user's way: the saved tokenizer, eos appended, a padded batch of uneven lengths
    for side in ("right", "left"):
        hf_tok.padding_side = side
        batch = hf_tok([t + hf_tok.eos_token for t in TEXTS], padding=True,
                       add_special_tokens=False, return_tensors="pt")  # fmt: skip
        assert (batch["input_ids"] == hf_tok.pad_token_id).any()  # uneven: one row is padded
        with torch.no_grad():
            hf_scores = hf_rm(**batch).logits[:, 0]
        torch.testing.assert_close(hf_scores, torch.stack(before), rtol=0, atol=1e-5)
    # rlhflab's scorer on the saved directory
    scorer = RewardModelScorer.from_pretrained(str(tmp_path / "rm"), kind="preference")
    prompts = [s[:3] for s in seqs]
    completions = [s[3:] for s in seqs]
    torch.testing.assert_close(
        scorer.score(prompts, completions), torch.stack(before), rtol=0, atol=1e-5
    )


def test_ensure_distinct_pad_keeps_scores_and_rng(rm, pad_is_eos):
    ids = torch.tensor([_ids(pad_is_eos, TEXTS[1])])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        before = final_token_scores(rm, ids, mask)
    rows = rm.get_input_embeddings().weight.size(0)
    torch.manual_seed(7)
    want_next = torch.rand(3)
    torch.manual_seed(7)
    assert ensure_distinct_pad(rm, pad_is_eos) is True
    assert torch.equal(torch.rand(3), want_next)  # growing the embeddings drew no random numbers
    emb = rm.get_input_embeddings().weight
    assert emb.size(0) == rows + 1 and torch.equal(emb[rows:], torch.zeros(1, emb.size(1)))
    with torch.no_grad():
        assert torch.equal(final_token_scores(rm, ids, mask), before)
    assert ensure_distinct_pad(rm, pad_is_eos) is False  # idempotent


def test_distinct_pad_is_left_alone(tiny_model, tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    rm = reward_model_from_causal_lm(tiny_model, num_labels=1, pad_token_id=tok.pad_token_id)
    n = len(tok)
    assert ensure_distinct_pad(rm, tok) is False
    assert len(tok) == n and rm.config.pad_token_id == tok.pad_token_id

"""Reward model: last-real-token scoring invariant to padding side, batch neighbours and pad id;
HF save/load round trip."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rlhflab.models.reward import (
    final_token_scores,
    last_token_index,
    load_reward_model,
    reward_model_from_causal_lm,
    save_reward_model,
    token_logits,
)

SEQS = [[10, 11, 12, 13, 1], [20, 21, 1], [30, 31, 32, 33, 34, 35, 1]]


def _pad(seqs, pad_id, side):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, sl] = torch.tensor(s)
        mask[i, sl] = 1
    return ids, mask


def _close(a, b):
    """Equal to float64 rounding: 1e4·eps relative to b's magnitude."""
    assert a.dtype == b.dtype == torch.float64
    atol = 1e4 * torch.finfo(torch.float64).eps * max(b.abs().max().item(), 1e-30)
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


@pytest.fixture
def rm(tiny_model, tiny_tokenizer):
    return reward_model_from_causal_lm(tiny_model, num_labels=1, pad_token_id=0).eval()


def test_last_token_index():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [3, 2, 0]


def test_score_invariant_to_padding_side_neighbours_and_pad_id(tiny_model64):
    """In float64: padded batches and rows alone add in other orders, which in float32 moves
    scores by ~1e-7 relative, differently with each CPU's kernels."""
    rm = reward_model_from_causal_lm(tiny_model64, num_labels=1, pad_token_id=0).eval()
    alone = torch.stack(
        [
            final_token_scores(rm, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0]
            for s in SEQS
        ]
    )
    for side in ("left", "right"):
        for pad_id in (0, 1):  # 1 is eos: pad == eos
            ids, mask = _pad(SEQS, pad_id, side)
            _close(final_token_scores(rm, ids, mask), alone)
    # a different neighbour in the batch changes nothing
    ids, mask = _pad([SEQS[0], [40] * 9 + [1]], 0, "left")
    _close(final_token_scores(rm, ids, mask)[0], alone[0])


def test_multi_class_head_shapes(tiny_model):
    prm = reward_model_from_causal_lm(tiny_model, num_labels=3)
    ids, mask = _pad(SEQS, 0, "left")
    assert token_logits(prm, ids, mask).shape == (3, 7, 3)
    assert final_token_scores(prm, ids, mask).shape == (3, 3)


def test_backbone_weights_copied(tiny_model, rm):
    lm_sd = tiny_model.base_model.state_dict()
    for k, v in rm.base_model.state_dict().items():
        torch.testing.assert_close(v, lm_sd[k])


def test_save_load_round_trip(rm, tiny_tokenizer, tmp_path):
    save_reward_model(rm, tiny_tokenizer, tmp_path / "rm")
    ids, mask = _pad(SEQS, 0, "right")
    want = final_token_scores(rm, ids, mask)
    back = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    torch.testing.assert_close(final_token_scores(back, ids, mask), want, atol=1e-6, rtol=0)
    # transformers' own pooling agrees when padding is on the right and pad != eos
    with torch.no_grad():
        hf = back(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    torch.testing.assert_close(hf, want, atol=1e-5, rtol=0)
    ours = load_reward_model(str(tmp_path / "rm"))
    torch.testing.assert_close(final_token_scores(ours, ids, mask), want, atol=1e-6, rtol=0)


def test_load_reward_model_from_causal_lm_dir(tiny_model, tiny_tokenizer, tmp_path):
    from rlhflab.models.build import save_pretrained

    save_pretrained(tiny_model, tiny_tokenizer, tmp_path / "lm")
    rm = load_reward_model(str(tmp_path / "lm"), num_labels=2)
    assert rm.config.num_labels == 2 and "ForSequenceClassification" in type(rm).__name__

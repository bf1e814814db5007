"""One batch vs k micro-batches through a real model: identical gradients in every aggregation
mode, with uneven completion lengths (denominators counted once per optimizer step).

In float64 (`tiny_model64`): the two add the same terms in other orders, which in float32 moves
the result by ~1e-7 relative, differently with each CPU's kernels; in float64 by ~1e-16."""

import pytest
import torch

from rlhflab.losses.aggregate import AGGREGATIONS, aggregate
from rlhflab.losses.policy import ppo_clip
from rlhflab.rollout.sampler import completion_logps, pack

PROMPTS = [[7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20], [30, 31, 32, 33, 34], [40, 41], [50]]
COMPLETIONS = [
    [60, 61],
    [62, 63, 64, 65, 66],
    [67],
    [68, 69, 70],
    [71, 72, 73, 74, 75, 76, 77],
    [78, 79],
]


def _grads(model, batch, adv, mode, splits):
    model.zero_grad()
    num_tokens, num_seqs, max_len = batch.mask.sum(), batch.mask.size(0), 8
    for rows in splits:
        micro = batch.select(torch.tensor(rows))
        logp, _ = completion_logps(model, micro)
        # logp_old slightly off-policy so the clip is active for some tokens
        loss_tok, _ = ppo_clip(
            logp, logp.detach() - 0.3, adv[rows], micro.mask, eps_low=0.2, eps_high=0.2
        )
        aggregate(
            loss_tok, micro.mask, mode, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len
        ).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_micro_batches_equal_one_batch(tiny_model64, tiny_tokenizer, mode):
    batch = pack(PROMPTS, COMPLETIONS, tiny_tokenizer.pad_token_id)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0, 0.3, -2.0])
    full = _grads(tiny_model64, batch, adv, mode, [list(range(6))])
    micro = _grads(tiny_model64, batch, adv, mode, [[0], [1, 2, 3], [4, 5]])  # uneven splits
    eps = torch.finfo(torch.float64).eps
    for name, g in full.items():
        assert g.dtype == torch.float64 and g.abs().max() > 0, name
        # float64 rounding of sums of a few hundred terms, relative to the tensor's magnitude
        atol = 1e4 * eps * g.abs().max().item()
        torch.testing.assert_close(micro[name], g, atol=atol, rtol=0, msg=name)

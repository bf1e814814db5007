"""The PG phases' own forward passes for issue #29: log-probs with a differentiable entropy (the
entropy bonus) and Σπ² (OTB's realised energy), against the model's full logits (float64)."""

from types import SimpleNamespace

import torch

from rlhflab.rollout.sampler import completion_logps, pack
from rlhflab.trainers.pg_phases import logps_with_entropy, no_grad_sum_pi_squared

PROMPTS = [[7, 8, 9], [10, 11, 12, 13], [20]]
COMPLETIONS = [[60, 61], [62, 63, 64, 65], [67]]


def _naive(model, batch, temperature):
    """log p of each completion token, entropy and Σp² from the whole sequence's logits."""
    lp, ent, spp = [], [], []
    for p, c in zip(PROMPTS, COMPLETIONS, strict=True):
        ids = torch.tensor([p + c])
        logits = model(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + len(c)] / temperature
        logq = torch.log_softmax(logits.double(), -1)
        row = torch.zeros(batch.mask.size(1), dtype=torch.float64)
        lp.append(row.index_put((torch.arange(len(c)),), logq[torch.arange(len(c)), c]))
        ent.append(row.index_put((torch.arange(len(c)),), -(logq.exp() * logq).sum(-1)))
        spp.append(row.index_put((torch.arange(len(c)),), (logq.exp() ** 2).sum(-1)))
    return torch.stack(lp), torch.stack(ent), torch.stack(spp)


def test_logps_with_entropy_and_sum_pi_squared(tiny_model64, tiny_tokenizer):
    batch = pack(PROMPTS, COMPLETIONS, tiny_tokenizer.pad_token_id)
    lp_ref, ent_ref, spp_ref = _naive(tiny_model64, batch, 0.7)
    logp, ent = logps_with_entropy(tiny_model64, batch, 0.7, None)
    torch.testing.assert_close(logp, lp_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-10)
    fused, _ = completion_logps(tiny_model64, batch, temperature=0.7)  # the trainer's usual path
    torch.testing.assert_close(logp, fused, rtol=0, atol=1e-10)
    # the bonus's gradient is the entropy's: compare with autograd through the naive entropy
    (g,) = torch.autograd.grad(ent.sum(), [tiny_model64.get_output_embeddings().weight])
    (g_ref,) = torch.autograd.grad(
        _naive(tiny_model64, batch, 0.7)[1].sum(), [tiny_model64.get_output_embeddings().weight]
    )
    assert g_ref.abs().max() > 0
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-10 * g_ref.abs().max().item())
    cfg = SimpleNamespace(train=SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=None),
                          rollout=SimpleNamespace(temperature=0.7))  # fmt: skip
    spp = no_grad_sum_pi_squared(tiny_model64, batch, cfg, None)
    torch.testing.assert_close(spp, spp_ref, rtol=0, atol=1e-10)

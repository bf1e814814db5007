"""Through a real tiny model: Dr. GRPO's loss does not depend on how padding is distributed, and
the value model reads one value per completion token, 0 on padding, saved and loaded intact."""

import torch

from rlhflab.losses.advantages import group_mean
from rlhflab.losses.aggregate import aggregate
from rlhflab.losses.policy import ppo_clip
from rlhflab.models.value import ValueModel
from rlhflab.rollout.dynamic import concat_rollouts
from rlhflab.rollout.sampler import Rollout, completion_logps, pack

PROMPTS = [[7, 8, 9], [10, 11, 12, 13], [20], [30, 31]]
COMPLETIONS = [[60, 61], [62, 63, 64, 65, 66], [67], [68, 69, 70]]
MAX_NEW_TOKENS = 12  # the constant normaliser of Dr. GRPO (generation budget)


def _widen(r: Rollout, width: int) -> Rollout:
    """The same completions right-padded to `width` columns."""
    return concat_rollouts([r, pack([[1]], [[2] * width], 0)], 0).select(slice(0, r.mask.size(0)))


def _dr_grpo_loss_and_grads(model, batches, adv, max_len):
    """Σ over micro-batches of the Dr. GRPO loss (group_mean adv, ppo_clip, constant normaliser)."""
    model.zero_grad()
    total = 0.0
    for micro, rows in batches:
        logp, _ = completion_logps(model, micro)
        loss_tok, _ = ppo_clip(logp, logp.detach() - 0.3, adv[rows], micro.mask)
        loss = aggregate(
            loss_tok, micro.mask, "seq_mean_token_sum_norm", num_seqs=len(adv), max_len=max_len
        )
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_dr_grpo_loss_is_independent_of_padding_layout(tiny_model64):
    """In float64: the layouts add the same terms in other orders (float32: ~1e-7 relative,
    differently with each CPU's kernels; float64: ~1e-16)."""
    tiny_model = tiny_model64
    eps = torch.finfo(torch.float64).eps
    adv = group_mean(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4)  # [.5, -.5, -.5, .5]
    full = pack(PROMPTS, COMPLETIONS, 0)  # width 5
    one = [(full, [0, 1, 2, 3])]
    wide = [(_widen(full, 9), [0, 1, 2, 3])]  # same rows padded to width 9
    # separate micro-batches, each padded only to its own width (5 and 3)
    split = [
        (pack(PROMPTS[:2], COMPLETIONS[:2], 0), [0, 1]),
        (pack(PROMPTS[2:], COMPLETIONS[2:], 0), [2, 3]),
    ]
    assert wide[0][0].mask.size(1) == 9 and split[1][0].mask.size(1) == 3
    ref_loss, ref_grads = _dr_grpo_loss_and_grads(tiny_model, one, adv, MAX_NEW_TOKENS)
    for layout in (wide, split):
        loss, grads = _dr_grpo_loss_and_grads(tiny_model, layout, adv, MAX_NEW_TOKENS)
        assert abs(loss - ref_loss) <= 1e4 * eps * max(abs(ref_loss), 1.0)
        for name, g in ref_grads.items():
            assert g.dtype == torch.float64, name
            atol = 1e4 * eps * g.abs().max().item()
            torch.testing.assert_close(grads[name], g, atol=atol, rtol=0, msg=name)
    # The test can fail: normalising by the padded width instead of a constant would differ.
    loss_w, _ = _dr_grpo_loss_and_grads(tiny_model, wide, adv, 9)
    loss_f, _ = _dr_grpo_loss_and_grads(tiny_model, one, adv, 5)
    assert abs(loss_w - loss_f) > 1e-4


def test_value_model_positions_padding_and_round_trip(tiny_model64, tmp_path):
    """In float64, so that "the same values" is checked to float64 rounding, on any CPU."""
    vm = ValueModel.from_policy(tiny_model64)
    assert vm.head.weight.dtype == torch.float64
    tol = 1e4 * torch.finfo(torch.float64).eps
    batch = pack(PROMPTS, COMPLETIONS, 0)
    zeros = torch.zeros_like(batch.mask, dtype=torch.float64)
    assert torch.equal(vm(batch), zeros)  # zero head: V = 0 at the start
    torch.nn.init.normal_(vm.head.weight, std=1.0)
    values = vm(batch)
    assert values.shape == batch.mask.shape
    assert torch.equal(values[batch.mask == 0], zeros[batch.mask == 0])
    # the backbone is a copy: training the critic leaves the policy alone
    assert vm.backbone is not tiny_model64.get_decoder()
    # batch neighbours and padding width do not change a row's values
    alone = vm(pack(PROMPTS[1:2], COMPLETIONS[1:2], 0))
    scale = values.abs().max().item()
    torch.testing.assert_close(values[1:2, :5], alone, atol=tol * scale, rtol=0)
    # V_t depends on o_<t only: changing the last token of row 1 leaves its values unchanged
    changed = pack(PROMPTS[1:2], [[*COMPLETIONS[1][:-1], 99]], 0)
    torch.testing.assert_close(vm(changed), alone, atol=tol * scale, rtol=0)
    vm.save(tmp_path / "v")
    loaded = ValueModel.load(tmp_path / "v")
    torch.testing.assert_close(loaded(batch), values, atol=1e-6, rtol=0)

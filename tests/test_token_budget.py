"""Token-budget micro-batches (`train.max_tokens_per_micro_batch`): the split itself
(`distributed.token_budget_split`) and scoring a micro-batch at its own widths
(`Rollout.trimmed`). That the trainers' updates equal fixed micro-batches' is checked per family
in tests/trainers (one process) and tests/distributed (one process against 2 ranks).

Scoring is compared in float64 (`tiny_model64`): the trimmed and untrimmed grids add the same
terms in other orders, which in float32 moves results by ~1e-7 relative, differently per CPU."""

import itertools
import random

import pytest
import torch

from rlhflab import distributed
from rlhflab.distributed import token_budget_split
from rlhflab.rollout.sampler import Rollout, _completion_logps, completion_logps, pack


def _grid(widths, part, seqs_per_row=1):
    """Padded tokens of a micro-batch, from the definition: sequences × Σ segment maxima."""
    segments = range(len(widths[0]))
    return seqs_per_row * len(part) * sum(max(widths[i][s] for i in part) for s in segments)


def test_padded_cells_by_hand():
    widths = [(2, 3), (1, 1), (4, 4), (2, 2)]
    assert distributed.padded_cells(widths, [0, 3]) == 2 * (2 + 3)  # column maxima 2 and 3
    assert distributed.padded_cells(widths, [0, 1, 3], seqs_per_row=2) == 2 * 3 * (2 + 3)
    assert distributed.padded_cells(widths, [2]) == 8
    assert distributed.padded_cells(widths, []) == 0


def test_split_by_hand():
    widths = [(2, 3), (1, 1), (4, 4), (2, 2)]  # totals 5, 2, 8, 4
    # longest first: row 2 (8) alone (with row 0 the grid is 2·8 = 16 > 10); rows 0 and 3 make
    # 2·(2+3) = 10; row 1 would make 3·5 = 15
    assert token_budget_split(widths, 10) == [[2], [0, 3], [1]]
    assert token_budget_split(widths, 100) == [[2, 0, 3, 1]]
    # a pair puts two sequences in the forward: the same rows cost twice as much
    assert token_budget_split([(1, 1), (1, 1)], 4) == [[0, 1]]
    assert token_budget_split([(1, 1), (1, 1)], 4, seqs_per_row=2) == [[0], [1]]
    # ties (three rows of 3 tokens) are broken by index, so the split is the same on every
    # call; the grid counts each segment's maximum: rows 0 and 1 (1+2, 2+1 tokens) lay out as
    # 2 sequences of 2 + 2 columns, 8 tokens, not 2·3
    assert token_budget_split([(1, 2), (2, 1), (3, 0)], 7) == [[0], [1], [2]]
    assert token_budget_split([(1, 2), (2, 1), (3, 0)], 8) == [[0, 1], [2]]


def test_a_row_over_the_budget_goes_alone():
    assert token_budget_split([(1, 1), (30, 30), (2, 0)], 10) == [[1], [0, 2]]


@pytest.mark.parametrize("seqs_per_row", [1, 2])
def test_split_covers_every_row_once_within_the_budget(seqs_per_row):
    rng = random.Random(seqs_per_row)
    for _ in range(300):
        n = rng.randint(1, 25)
        widths = [(rng.randint(1, 20), rng.randint(0, 40)) for _ in range(n)]
        budget = rng.randint(10, 400)
        parts = token_budget_split(widths, budget, seqs_per_row)
        assert sorted(itertools.chain(*parts)) == list(range(n))
        for part in parts:
            assert len(part) == 1 or _grid(widths, part, seqs_per_row) <= budget
        # greedy: each micro-batch was closed because the next row would not fit in it
        for a, b in itertools.pairwise(parts):
            assert _grid(widths, [*a, b[0]], seqs_per_row) > budget


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        token_budget_split([(1, 1)], 0)
    with pytest.raises(ValueError, match="same number of segments"):
        token_budget_split([(1, 1), (1,)], 10)
    with pytest.raises(ValueError, match="one `widths` entry per row"):
        distributed.micro_batches([0, 1], 1, max_tokens=10, widths=[(1, 1)])


def test_micro_batches_with_a_budget_in_one_process():
    rows = ["a", "b", "c", "d"]
    widths = [(2, 3), (1, 1), (4, 4), (2, 2)]
    got = distributed.micro_batches(rows, 1, widths=widths, max_tokens=10)
    assert got == [(["c"], 1.0), (["a", "d"], 1.0), (["b"], 1.0)]
    # without a budget: `size` rows each, in order
    assert distributed.micro_batches(rows, 3) == [(["a", "b", "c"], 1.0), (["d"], 1.0)]


def _rollout():
    """Rows of uneven lengths, laid out wider than they need: one all-padding prompt column in
    front, and completion columns past every row's last scored token (one of them a real but
    unscored token, as a truncated turn leaves)."""
    ro = pack([[7, 8, 9], [10], [11, 12]], [[20, 21], [22, 23, 24], [25]], 0)
    B, T = ro.mask.shape
    comp = torch.cat([ro.completion_ids, torch.full((B, 3), 0)], 1)
    comp[0, T] = 26  # a token after the last scored one of every row
    mask = torch.cat([ro.mask, torch.zeros(B, 3)], 1)
    return Rollout(
        torch.cat([torch.zeros(B, 1, dtype=torch.long), ro.prompt_ids], 1),
        torch.cat([torch.zeros(B, 1, dtype=torch.long), ro.prompt_mask], 1),
        comp,
        mask,
        torch.zeros_like(mask),
        ro.truncated,
    )


def test_widths_and_trimmed_layout():
    ro = _rollout()
    assert ro.widths() == [(3, 2), (1, 3), (2, 1)]
    t = ro.trimmed()
    assert t.prompt_ids.shape == (3, 3) and t.completion_ids.shape == (3, 3)
    assert torch.equal(t.prompt_ids, ro.prompt_ids[:, 1:])
    assert torch.equal(t.mask, ro.mask[:, :3])
    assert t.trimmed() is t  # nothing left to drop


@pytest.mark.parametrize("packable", [True, False])
def test_trimmed_scoring_equals_the_wide_layout(tiny_model64, monkeypatch, packable):
    """Log-probs, entropies and gradients of a micro-batch scored at its own widths equal those of
    the wide layout (float64 rounding), on the packed and the padded path."""
    import rlhflab.rollout.sampler as sampler

    if not packable:
        monkeypatch.setattr(sampler, "can_pack", lambda model: False)
    ro = _rollout()
    out = []
    for fn in (completion_logps, _completion_logps):
        lp, ent = fn(tiny_model64, ro, temperature=0.7, with_entropy=True, autocast_dtype=None)
        (lp.sum() + (lp * lp).sum()).backward()
        grads = [p.grad.clone() for p in tiny_model64.parameters() if p.grad is not None]
        tiny_model64.zero_grad()
        out.append((lp.detach(), ent, grads))
    (lp1, e1, g1), (lp0, e0, g0) = out
    assert lp1.shape == lp0.shape == ro.mask.shape
    eps = torch.finfo(torch.float64).eps
    for a, b in [(lp1, lp0), (e1, e0), *zip(g1, g0, strict=True)]:
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, atol=1e4 * eps * b.abs().max().item(), rtol=0)


@pytest.mark.parametrize("packable", [True, False])
def test_trimmed_trajectories_keep_the_environments_tokens_attended(
    tiny_model64, monkeypatch, packable
):
    """A multi-turn trajectory: environment tokens (attended, not scored) between the model's
    turns and after its last one. Trimming keeps the interior ones attended (`attend` is cut with
    the columns), so the log-probs equal the wide layout's."""
    import rlhflab.rollout.sampler as sampler
    from rlhflab.rollout.trajectory import Trajectory, pack_trajectories

    if not packable:
        monkeypatch.setattr(sampler, "can_pack", lambda model: False)
    tokens = [[20, 21, 90, 91, 22, 92, 93], [23, 94, 24], [25, 26, 95, 96, 97, 98, 99, 100]]
    is_model = [[1, 1, 0, 0, 1, 0, 0], [1, 0, 1], [1, 1, 0, 0, 0, 0, 0, 0]]
    ro = pack_trajectories([[7, 8, 9], [10], [11, 12]], tokens, is_model,
                           [[0.0] * len(t) for t in tokens], [False] * 3, 0)  # fmt: skip
    t = ro.trimmed()
    assert isinstance(t, Trajectory) and t.completion_ids.size(1) == 5 < ro.mask.size(1)
    assert torch.equal(t.attend, ro.attend[:, :5])
    lp1, _ = completion_logps(tiny_model64, ro)
    lp0, _ = _completion_logps(tiny_model64, ro, temperature=1.0, with_entropy=False,
                               autocast_dtype=None)  # fmt: skip
    eps = torch.finfo(torch.float64).eps
    torch.testing.assert_close(lp1, lp0, atol=1e4 * eps * lp0.abs().max().item(), rtol=0)

"""Gao et al. replication (`rlhflab replicate rm-overopt`): the continuous gold, the exact
best-of-n expectation, the intercept-free fits of d(α − βd) and d(α − β log d), their peaks, the
estimates of the criterion on constructed cell results, the exact sequence KL, and the cell
protocol end to end on a tiny config."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import pytest

from rlhflab.replications.rm_overopt import (
    POSITION_CAP,
    best_of_n_expectation,
    bon_estimates,
    bon_kl,
    bon_peak,
    char_similarity,
    fit_bon,
    fit_rl,
    levenshtein,
    rl_estimates,
    rl_peak,
    sequence_kl,
)

ROOT = Path(__file__).resolve().parents[1]


def test_levenshtein_and_char_similarity_by_hand():
    assert levenshtein("kitten", "sitting") == 3  # k→s, e→i, +g
    assert levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0
    assert levenshtein("ab", "ba") == 2  # no transpositions
    assert char_similarity("cimho", "cimho") == 1.0
    assert char_similarity("cimhx", "cimho") == pytest.approx(1 - 1 / 5, abs=1e-15)
    assert char_similarity(" AdnuB ", "adnub") == 1.0  # stripped, lower-cased as the verifier
    assert char_similarity("adnubxx", "adnub") == pytest.approx(1 - 2 / 7, abs=1e-15)
    assert char_similarity("", "abc") == 0.0 and char_similarity(None, "abc") == 0.0


def _brute_force_best_of_n(scores, values, n):
    """Mean over every n-subset of the value of its highest-scored sample, ties split evenly."""
    total, count = 0.0, 0
    for subset in itertools.combinations(range(len(scores)), n):
        top = max(scores[i] for i in subset)
        tied = [i for i in subset if scores[i] == top]
        total += sum(values[i] for i in tied) / len(tied)
        count += 1
    return total / count


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_best_of_n_expectation_equals_the_enumeration_of_subsets(n):
    rng = random.Random(n)
    scores = [0.3, 0.9, 0.3, 0.1, 0.9, 0.5]  # two ties, one at the top
    values = [rng.random() for _ in scores]
    assert best_of_n_expectation(scores, values, n) == pytest.approx(
        _brute_force_best_of_n(scores, values, n), abs=1e-12
    )
    # n = 1 is the pool mean; n = K is the mean value of the top-scored (tied) samples
    assert best_of_n_expectation(scores, values, 1) == pytest.approx(sum(values) / 6, abs=1e-12)
    assert best_of_n_expectation(scores, values, 6) == pytest.approx(
        (values[1] + values[4]) / 2, abs=1e-12
    )
    with pytest.raises(ValueError, match="1 <= n <= K"):
        best_of_n_expectation(scores, values, 7)


def test_fits_without_intercept_by_hand_and_recover_known_coefficients():
    # y = a·d − b·d² through (1, 1) and (2, 0): 1 = a − b, 0 = 2a − 4b → a = 2, b = 1
    assert fit_bon([1.0, 2.0], [1.0, 0.0]) == pytest.approx((2.0, 1.0), abs=1e-12)
    d = [0.0, 0.3, 0.7, 1.1, 1.6, 2.2]
    y = [x * (0.2 - 0.15 * x) for x in d]
    assert fit_bon(d, y) == pytest.approx((0.2, 0.15), abs=1e-12)
    y = [x * (0.05 - 0.08 * math.log(x)) if x > 0 else 0.0 for x in d]
    assert fit_rl(d, y) == pytest.approx((0.05, 0.08), abs=1e-12)
    with pytest.raises(ValueError, match="singular"):
        fit_bon([0.0, 1.0], [0.0, 0.5])  # one non-zero point for two coefficients


def test_peaks_are_the_maxima_of_the_fitted_curves():
    # d(2 − d): d* = 1, R* = 1; as a fraction of d_max = 2: 0.5
    assert bon_peak(2.0, 1.0, 2.0) == pytest.approx((0.5, 1.0), abs=1e-12)
    # no turn (β ≤ 0): the cap, and the curve's maximum on the range is at d_max
    pos, peak = bon_peak(0.1, -0.05, 2.0)
    assert pos == POSITION_CAP and peak == pytest.approx(2.0 * (0.1 + 0.05 * 2.0), abs=1e-12)
    # falling from the start (α < 0): d* < 0, the maximum on [0, d_max] is 0 (at d = 0)
    pos, peak = bon_peak(-0.1, 0.2, 2.0)
    assert pos < 0 and peak == 0.0
    # d(1 − log d): d* = exp(α/β − 1) = 1, R* = 1; d_max = 4 → 0.25
    assert rl_peak(1.0, 1.0, 4.0) == pytest.approx((0.25, 1.0), abs=1e-12)
    grid = [4.0 * i / 4000 for i in range(1, 4001)]
    best = max(grid, key=lambda x: x * (0.3 - 0.2 * math.log(x)))
    pos, peak = rl_peak(0.3, 0.2, 4.0)
    assert pos * 4.0 == pytest.approx(best, abs=1e-3)
    assert peak == pytest.approx(best * (0.3 - 0.2 * math.log(best)), abs=1e-6)


def _proxy(n_prompts, a, b, ns, base=(0.5, 0.7)):
    """A proxy cell whose problems' gold is base_i + d(a − b·d) at every n (exact curve)."""
    rows = [[g0 + math.sqrt(bon_kl(n)) * (a - b * math.sqrt(bon_kl(n))) for n in ns]
            for g0 in base]  # fmt: skip
    return {"n_prompts": n_prompts, "per_problem": {"gold": rows}}


def test_best_of_n_estimates_on_constructed_cells():
    ns = [1, 2, 4, 8, 16, 32, 64]
    d = [math.sqrt(bon_kl(n)) for n in ns]
    small, large = _proxy(64, 0.1, 0.1, ns), _proxy(2048, 0.2, 0.15, ns)
    est = bon_estimates([small, large], ns, [0, 1])
    assert est["alpha_2048"] == pytest.approx(0.2, abs=1e-9)
    assert est["beta_64"] == pytest.approx(0.1, abs=1e-9)
    # peaks: d* = α/(2β) → 0.5 and 2/3; peak gold α²/(4β) → 0.025 and 1/15
    assert est["peak_d_64"] == pytest.approx(0.5, abs=1e-9)
    assert est["bon_peak_position_largest"] == pytest.approx((2 / 3) / d[-1], abs=1e-9)
    assert est["bon_peak_gain"] == pytest.approx(0.2**2 / 0.6 - 0.1**2 / 0.4, abs=1e-9)
    last = d[-1] * (0.2 - 0.15 * d[-1])
    assert est["bon_drop_largest"] == pytest.approx(last - 0.2**2 / 0.6, abs=1e-9)
    assert est["bon_peak_d_shift"] == pytest.approx(2 / 3 - 0.5, abs=1e-9)


def test_rl_estimates_pool_the_seeds_and_subtract_each_seed_start():
    def seed(g0, ks):
        cps = []
        for k in ks:  # two problems with the same KL k and gold g0 + d(α − β log d)
            x = math.sqrt(k)
            y = x * (0.05 - 0.04 * math.log(x)) if x > 0 else 0.0
            cps.append({"kl": [k, k], "gold": [g0 + y, g0 + y]})
        return {"checkpoints": cps}

    seeds = [seed(0.6, [0.0, 0.1, 0.5, 1.0, 3.0, 6.0]), seed(0.3, [0.0, 0.2, 0.9, 2.0, 4.0])]
    est = rl_estimates(seeds, [0, 1])
    assert (est["rl_alpha"], est["rl_beta"]) == pytest.approx((0.05, 0.04), abs=1e-9)
    d_star = math.exp(0.05 / 0.04 - 1)
    assert est["rl_peak_d"] == pytest.approx(d_star, abs=1e-9)
    last = [math.sqrt(k) * (0.05 - 0.04 * math.log(math.sqrt(k))) for k in (6.0, 4.0)]
    assert est["rl_drop"] == pytest.approx(sum(last) / 2 - 0.04 * d_star, abs=1e-9)


def test_sequence_kl_is_the_summed_exact_token_kl(tiny_model64, tiny_tokenizer):
    import copy

    import torch

    other = copy.deepcopy(tiny_model64)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1),
                                      dtype=p.dtype))  # fmt: skip
    prompt = tiny_tokenizer("Q: abc", add_special_tokens=False)["input_ids"]
    comps = [[5, 9, 7], [11]]
    got = sequence_kl(tiny_model64, other, [prompt, prompt], comps)

    @torch.no_grad()
    def naive(tokens):  # one forward per position, the KL of the full next-token distributions
        total = 0.0
        for t in range(len(tokens)):
            ids = torch.tensor([prompt + tokens[:t]])
            p = torch.log_softmax(tiny_model64(input_ids=ids).logits[0, -1].double(), -1)
            q = torch.log_softmax(other(input_ids=ids).logits[0, -1].double(), -1)
            total += float((p.exp() * (p - q)).sum())
        return total

    assert got == pytest.approx([naive(c) for c in comps], rel=1e-9, abs=1e-12)
    assert got[0] > 0
    assert sequence_kl(tiny_model64, tiny_model64, [prompt], [comps[0]]) == [0.0]


@pytest.mark.slow
def test_cells_end_to_end_on_a_tiny_config(tmp_path, monkeypatch):
    from rlhflab.config import read_yaml
    from rlhflab.replications import rm_overopt
    from rlhflab.replications.cells import run_cells

    monkeypatch.chdir(ROOT)
    spec = read_yaml(ROOT / "configs/replications/rm_overopt.yaml")
    spec["experiment"].update(ns=[1, 2, 4], heldout_problems=6, proxy_prompts=[4, 8],
                              rl_seeds=[0], rl_eval_every=1, rl_eval_problems=3,
                              rl_eval_samples=2, n_boot=100)  # fmt: skip
    task = {**spec["sft"]["task"], "n_train": 100}
    spec["sft"].update(task=task, train={"steps": 2, "batch_size": 8, "micro_batch_size": 8,
                                         "max_len": 64})  # fmt: skip
    spec["rm"].update(task=task, train={"steps": 2, "batch_size": 4, "micro_batch_size": 4})
    spec["rm"]["data"]["samples_per_prompt"] = 2
    spec["rm"]["eval"]["n_problems"] = 2
    spec["rl"].update(task=task, train={"steps": 2, "micro_batch_size": 4})
    spec["rl"]["rollout"].update(prompts_per_step=2, group_size=2)
    assert rm_overopt.cells(spec, "x.yaml") == ["proxy-4", "proxy-8", "rl-seed0"]
    out = tmp_path / "out"
    res = run_cells("rm-overopt", rm_overopt, spec, out, "x.yaml", print_fn=lambda s: None)
    verdict = json.loads((out / "verdict.json").read_text())
    assert {"name", "claim", "criterion", "estimate", "ci95", "seeds", "reproduced"} <= set(verdict)
    assert [c["key"] for c in verdict["checks"]] == [c.key for c in rm_overopt.CRITERION.checks]
    assert "secondary" in verdict and verdict["seeds"] == [0]
    assert (out / "rm_overopt.png").is_file() and "(rm_overopt.png)" in res["report"]
    cell = json.loads((out / "cells/proxy-8.json").read_text())
    assert len(cell["per_problem"]["gold"]) == 6 and len(cell["per_problem"]["gold"][0]) == 3
    rl = json.loads((out / "cells/rl-seed0.json").read_text())
    assert [c["step"] for c in rl["checkpoints"]] == [0, 1, 2]
    assert rl["checkpoints"][0]["kl"] == [0.0, 0.0, 0.0]  # the start policy is the reference

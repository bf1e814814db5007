"""The DPO over-optimisation replication (`rlhflab replicate dpo-overopt`): the split-half hump
estimate and the KL comparison on constructed cell results (hand arithmetic), and one tiny run of
the module through the cell runner (prepare → cells → report → verdict)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rlhflab.replications.dpo_overopt import (
    CRITERION,
    HUMP_CRITERION,
    budget_hump,
    cells,
    estimates,
    measured_steps,
    per_seed_rows,
    rise_and_fall,
)

ROOT = Path(__file__).resolve().parents[1]
T975_DF2 = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom (tables)


def _point(step, even, odd, kl=0.0):
    return {"step": step, "gold_even": even, "gold_odd": odd, "greedy_even": even,
            "greedy_odd": odd, "gold": (even + odd) / 2, "greedy": (even + odd) / 2, "kl": kl}  # fmt: skip


def test_rise_and_fall_pick_the_peak_on_the_even_half_and_measure_on_the_odd_half():
    # Three seeds, four checkpoints. Even half (selection): mean over seeds 0.2, 0.3, 0.5, 0.4 →
    # peak index 2. The odd half has its own maximum at index 1 (0.9): it must not be chosen.
    evens = [[0.2, 0.3, 0.5, 0.4], [0.1, 0.2, 0.6, 0.3], [0.3, 0.4, 0.4, 0.5]]
    odds = [[0.10, 0.90, 0.30, 0.20], [0.20, 0.90, 0.25, 0.25], [0.15, 0.90, 0.35, 0.15]]
    curves = [
        [_point(4 * i, e[i], o[i]) for i in range(4)] for e, o in zip(evens, odds, strict=True)
    ]
    got = rise_and_fall(curves)
    assert got["peak_index"] == 2
    # rise per seed = odd[2] - odd[0]: 0.20, 0.05, 0.20 → mean 0.15, s = sqrt(0.0075)
    # fall per seed = odd[3] - odd[2]: -0.10, 0.00, -0.20 → mean -0.10, s = 0.1
    assert got["rises"] == pytest.approx([0.20, 0.05, 0.20], abs=1e-12)
    assert got["falls"] == pytest.approx([-0.10, 0.00, -0.20], abs=1e-12)
    m, lo, hi = got["rise"]
    half = T975_DF2 * math.sqrt(0.0075) / math.sqrt(3)
    assert (m, lo, hi) == pytest.approx((0.15, 0.15 - half, 0.15 + half), abs=1e-9)
    m, lo, hi = got["fall"]
    half = T975_DF2 * 0.1 / math.sqrt(3)
    assert (m, lo, hi) == pytest.approx((-0.10, -0.10 - half, -0.10 + half), abs=1e-9)


def test_rise_and_fall_take_the_earliest_of_tied_peaks_and_refuse_ragged_curves():
    flat = [[_point(0, 0.4, 0.1), _point(4, 0.4, 0.3), _point(8, 0.4, 0.2)] for _ in range(2)]
    got = rise_and_fall(flat)
    assert got["peak_index"] == 0 and got["rises"] == [0.0, 0.0]  # no rise when step 0 wins
    with pytest.raises(ValueError, match="one length"):
        rise_and_fall([flat[0], flat[0][:2]])


def _cell(beta, seed, kl_last, odd):
    pts = [_point(4 * i, 0.5 if i == 1 else 0.2, odd[i], kl=kl_last * i / 2) for i in range(3)]
    return {"beta": beta, "seed": seed, "points": pts}


def test_estimates_give_every_criterion_key_and_the_kl_gap_paired_over_seeds():
    results = {}
    for seed, (k_low, k_high) in enumerate([(2.0, 0.5), (1.6, 0.4), (1.9, 0.3)]):
        for beta, kl in ((0.01, k_low), (0.03, 1.0), (1.0, k_high)):
            results[f"beta{beta:g}-seed{seed}"] = _cell(
                beta, seed, kl, [0.1, 0.3 + 0.01 * seed, 0.2]
            )
    est, per_beta, _ = estimates(results)
    assert {c.key for c in (*CRITERION.checks, *HUMP_CRITERION.checks)} <= set(est)
    # peak at index 1 (even half 0.5); rise = 0.3 + 0.01 s - 0.1, fall = 0.2 - (0.3 + 0.01 s)
    assert est["rise_beta_0.01"][0] == pytest.approx(0.21, abs=1e-12)
    assert est["fall_beta_0.01"][0] == pytest.approx(-0.11, abs=1e-12)
    # KL gap per seed: 1.5, 1.2, 1.6 → mean 4.3/3, s from the three values
    gaps = [1.5, 1.2, 1.6]
    m = sum(gaps) / 3
    s = math.sqrt(sum((g - m) ** 2 for g in gaps) / 2)
    got = est["kl_gap_0.01_vs_1"]
    assert got == pytest.approx((m, m - T975_DF2 * s / math.sqrt(3), m + T975_DF2 * s / math.sqrt(3)),
                                abs=1e-9)  # fmt: skip
    assert per_beta[0.01]["peak_step"] == 4
    del results["beta1-seed0"], results["beta1-seed1"], results["beta1-seed2"]
    with pytest.raises(ValueError, match=r"needs β \[1.0\]"):
        estimates(results)


def test_budget_hump_picks_the_best_point_over_every_beta_on_the_even_half():
    # Two seeds, βs 0.01 and 1, three checkpoints each. Even half, mean over seeds:
    #   β = 0.01: 0.2, 0.3, 0.1   β = 1: 0.2, 0.25, 0.6 → best point: β = 1, index 2 (step 8).
    # The odd half's own maximum (β = 0.01, index 1: 0.9) must not be chosen.
    def cell(beta, seed, evens, odds, kls):
        pts = [{"step": 4 * i, "gold_even": e, "gold_odd": o, "kl": k}
               for i, (e, o, k) in enumerate(zip(evens, odds, kls, strict=True))]  # fmt: skip
        return {"beta": beta, "seed": seed, "points": pts}

    by_beta = {
        0.01: [cell(0.01, 3, [0.2, 0.3, 0.1], [0.10, 0.90, 0.05], [0, 2, 6]),
               cell(0.01, 4, [0.2, 0.3, 0.1], [0.20, 0.90, 0.10], [0, 3, 5])],
        1.0: [cell(1.0, 3, [0.2, 0.2, 0.7], [0.10, 0.30, 0.40], [0, 1, 2]),
              cell(1.0, 4, [0.2, 0.3, 0.5], [0.20, 0.30, 0.50], [0, 1, 7])],
    }  # fmt: skip
    got = budget_hump(by_beta)
    assert got["best"] == (1.0, 8)
    # rise per seed: 0.40 - 0.10, 0.50 - 0.20; fall: lowest β's last (0.05, 0.10) - best (0.4, 0.5)
    assert got["rises"] == pytest.approx([0.30, 0.30], abs=1e-12)
    assert got["falls"] == pytest.approx([-0.35, -0.40], abs=1e-12)
    # ρ(β, last KL): seed 3 (6 vs 2) → -1; seed 4 (5 vs 7) → +1
    assert got["rhos"] == pytest.approx([-1.0, 1.0], abs=1e-12)
    m, lo, hi = got["fall"]
    assert m == pytest.approx(-0.375, abs=1e-12) and lo < m < hi
    del by_beta[1.0][1]
    with pytest.raises(ValueError, match="same seeds"):
        budget_hump(by_beta)


def test_measured_steps_are_dense_then_sparse_and_always_end_at_the_last_step():
    # every 2 up to step 4 (0, 2, 4), then multiples of 3 after it (6, 9), and the last step 10
    assert measured_steps(10, 2, 4, 3) == [0, 2, 4, 6, 9, 10]
    # one schedule throughout: multiples of 4, then the last step
    assert measured_steps(10, 4) == [0, 4, 8, 10]
    # one epoch of 64 steps every 8, then every 32 up to 3 epochs (192 = a multiple: no repeat)
    assert measured_steps(192, 8, 64, 32) == [0, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192]
    with pytest.raises(ValueError, match="measured_steps"):
        measured_steps(0, 4)


def test_spec_refuses_a_sparse_period_without_its_dense_end():
    from rlhflab.errors import ConfigError
    from rlhflab.replications import check_experiment
    from rlhflab.replications.dpo_overopt import Spec

    with pytest.raises(ConfigError, match="dense_until and every_after go together"):
        check_experiment(Spec, {"every_after": 32}, "x.yaml")


def test_per_seed_rows_name_the_highest_checkpoint_and_the_last_one():
    # one cell: gold 0.2, 0.5, 0.5, 0.1 at steps 0, 4, 8, 12 → highest 0.5 first reached at step 4
    pts = [{"step": 4 * i, "gold": g, "kl": 0.5 * i} for i, g in enumerate([0.2, 0.5, 0.5, 0.1])]
    rows = per_seed_rows({"beta0.01-seed3": {"beta": 0.01, "seed": 3, "points": pts}})
    assert rows[2] == "| 0.01 | 3 | 0.200 | 0.500 (4) | 0.100 | 1.50 |"


def test_cells_are_beta_by_seed():
    spec = {"experiment": {"betas": [0.01, 0.03, 1.0], "seeds": [3, 5]}}
    assert cells(spec, "x.yaml") == ["beta0.01-seed3", "beta0.03-seed3", "beta1-seed3",
                                     "beta0.01-seed5", "beta0.03-seed5", "beta1-seed5"]  # fmt: skip


def test_betas_without_the_criterions_are_refused_before_any_training():
    from rlhflab.errors import ConfigError

    spec = {"experiment": {"betas": [0.01, 1.0]}}
    with pytest.raises(
        ConfigError,
        match=r"^x\.yaml: experiment\.betas: must include the β "
        r"values the criterion reads \(0\.01, 0\.03, 1\); missing 0\.03 \(got",
    ):
        cells(spec, "x.yaml")


@pytest.mark.slow
def test_tiny_replication_runs_through_the_cell_runner(tmp_path, monkeypatch):
    from rlhflab.config import apply_overrides, read_yaml
    from rlhflab.replications import dpo_overopt
    from rlhflab.replications.cells import run_cells

    monkeypatch.chdir(ROOT)
    spec = apply_overrides(read_yaml(ROOT / "configs/replications/dpo_overopt.yaml"), [
        "experiment.betas=[0.01,0.03,1.0]", "experiment.seeds=[0,1]", "experiment.every=2",
        "experiment.dense_until=2", "experiment.every_after=3",
        "experiment.heldout_problems=8", "sft.train.steps=3", "sft.task.n_train=200",
        "sft.model.build.size=tiny", "dpo.task.n_train=200", "dpo.verifiable.n_prompts=8",
        "dpo.verifiable.samples_per_prompt=2", "dpo.train.steps=4", "dpo.train.batch_size=4",
        "dpo.train.micro_batch_size=4",
    ])  # fmt: skip
    out = tmp_path / "out"
    res = run_cells("dpo-overopt", dpo_overopt, spec, out, "dpo_overopt.yaml",
                    print_fn=lambda line: None)  # fmt: skip
    verdict = json.loads((out / "verdict.json").read_text())
    assert set(verdict) >= {"name", "claim", "criterion", "estimate", "ci95", "seeds", "reproduced"}
    assert verdict["seeds"] == [0, 1] and len(verdict["checks"]) == len(CRITERION.checks)
    assert len(verdict["secondary"]["checks"]) == len(HUMP_CRITERION.checks)
    cell = json.loads((out / "cells" / "beta0.01-seed1.json").read_text())
    # every 2 steps up to step 2, then multiples of 3, and the last step
    assert [p["step"] for p in cell["points"]] == [0, 2, 3, 4]
    assert cell["points"][0]["kl"] == pytest.approx(0.0, abs=1e-5)  # π = π_ref at step 0
    assert cell["loss"]["args"] == {"beta": 0.01, "alpha": pytest.approx(0.001)}  # α = 0.1 β
    assert (out / "dpo_overopt.png").is_file() and "dpo_overopt.png" in res["report"]

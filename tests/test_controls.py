"""`rlhflab controls RUN_DIR` (issue #42): the budget read from the run, the RFT control's loss
against its definition, and the whole command on a tiny GRPO run — every arm evaluated on the
run's held-out set, RL − control paired by problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from factories import tiny_pg, tiny_sft

from rlhflab.cli import main
from rlhflab.config import config_from_dict
from rlhflab.controls import training_seconds, verdict
from rlhflab.errors import ConfigError
from rlhflab.losses.advantages import ADVANTAGES
from rlhflab.losses.aggregate import aggregate
from rlhflab.losses.policy import ppo_clip
from rlhflab.trainers import run_config


def test_training_seconds_sums_step_time_without_evaluations(tmp_path):
    rows = [
        {"step": 1, "perf/step_s": 0.5, "perf/eval_s": 0.0},
        {"step": 2, "perf/step_s": 2.25, "perf/eval_s": 2.0},  # an evaluation inside the step
        {"step": 2, "eval/accuracy": 0.5},  # an eval row: no perf
        {"step": 3, "perf/step_s": 0.75},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = training_seconds(tmp_path)
    assert got == {"seconds": 1.5, "steps": 3, "eval_seconds": 2.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n")
    with pytest.raises(ConfigError, match="stage_timers"):
        training_seconds(tmp_path)


def test_verdict_reads_the_interval():
    assert verdict({"lo": 0.01, "hi": 0.2}, "SFT") == "RL beat SFT"
    assert verdict({"lo": -0.2, "hi": -0.01}, "SFT") == "SFT beat RL"
    assert verdict({"lo": -0.1, "hi": 0.1}, "SFT") == "not resolved at 95%"


def test_rft_loss_is_nll_on_accepted_samples_over_all_sequences():
    """The RFT control's update (advantage "none" = the raw reward, PPO-clip at ratio 1, the
    run's seq_mean_token_mean) has the gradient of the definition
    (1/B) Σ_{i: r_i = 1} (1/|o_i|) Σ_t −log π(o_it): SFT on the accepted samples, over all B."""
    torch.manual_seed(0)
    mask = torch.tensor(
        [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.float64
    )
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    logp = (-torch.rand(4, 4, dtype=torch.float64)).requires_grad_()
    adv = ADVANTAGES["none"].fn(rewards)
    loss, _ = ppo_clip(logp, logp.detach(), adv, mask)
    agg = aggregate(loss, mask, "seq_mean_token_mean", num_seqs=4, num_tokens=mask.sum())
    (g,) = torch.autograd.grad(agg, logp)
    want = torch.zeros(4, 4, dtype=torch.float64)
    for i in range(4):
        if rewards[i] == 1:
            want[i] = -mask[i] / mask[i].sum() / 4
    assert torch.allclose(g, want, atol=1e-15)


@pytest.mark.slow
def test_controls_on_a_tiny_grpo_run(tmp_path, capsys):
    sft = run_config(config_from_dict(tiny_sft(tmp_path / "sft", precision={"threads": 1})))
    cfg = tiny_pg(tmp_path / "pg", sft["model_dir"], train={"steps": 3, "micro_batch_size": 16},
                  eval={"n": 12, "max_new_tokens": 6}, precision={"threads": 1})  # fmt: skip
    rl = run_config(config_from_dict(cfg))
    run_dir = Path(rl["run_dir"])
    out = tmp_path / "ctl"
    argv = ["controls", str(run_dir), "--budget", "samples", "--out", str(out), "--json"]
    assert main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    arms, paired = rep["arms"], rep["paired"]
    # same start, same held-out set, evaluated by the same code as the run's own evaluations
    assert arms["start"]["accuracy"] == rl["heldout_accuracy_before"]
    assert arms["rl"]["accuracy"] == rl["heldout_accuracy"]
    # --budget samples: every trained control makes the run's 3 steps
    assert arms["sft"]["steps"] == arms["rft"]["steps"] == 3
    assert {"bon", "maj"} <= set(arms) and arms["bon"]["n"] == 4  # the run's group size
    assert arms["maj"]["accuracy"] <= arms["bon"]["accuracy"]  # pass@N bounds majority of N
    for name in ("start", "sft", "rft", "bon", "maj"):
        d = paired[name]
        assert d["n"] == 12
        # the mean of per-problem differences is the difference of the two accuracies
        assert d["mean"] == pytest.approx(
            arms["rl"]["accuracy"] - arms[name]["accuracy"], abs=1e-12
        )
        assert d["lo"] <= d["mean"] <= d["hi"]
    # the interval is the 95% t interval of the per-problem differences, by hand
    per = rep["per_problem"]
    for name in ("sft", "bon"):
        diffs = [a - b for a, b in zip(per["rl"], per[name], strict=True)]
        mean = sum(diffs) / 12
        sd = (sum((x - mean) ** 2 for x in diffs) / 11) ** 0.5
        half = 2.200985160082949 * sd / 12**0.5  # t_{.975, 11} from tables
        assert paired[name]["lo"] == pytest.approx(mean - half, abs=1e-12)
        assert paired[name]["hi"] == pytest.approx(mean + half, abs=1e-12)
    readme = (out / "README.md").read_text()
    assert "| SFT on gold |" in readme and "At equal steps" in readme
    # the same folder again: refused, nothing overwritten
    assert main(argv) == 2
    assert "exists" in capsys.readouterr().err


@pytest.mark.slow
def test_controls_paired_over_two_runs(tmp_path, capsys):
    """Two seeds of the same GRPO config: each run gets its own controls, and RL − control is
    paired over the runs (t interval with 1 degree of freedom, by hand)."""
    sft = run_config(config_from_dict(tiny_sft(tmp_path / "sft", precision={"threads": 1})))
    runs = []
    for seed in (0, 1):
        cfg = tiny_pg(tmp_path / "pg", sft["model_dir"], seed=seed,
                      train={"steps": 2, "micro_batch_size": 16},
                      eval={"n": 8, "max_new_tokens": 6}, precision={"threads": 1},
                      run={"name": f"grpo-s{seed}", "root": str(tmp_path / "pg")})  # fmt: skip
        runs.append(run_config(config_from_dict(cfg))["run_dir"])
    out = tmp_path / "ctl"
    argv = ["controls", *runs, "--budget", "samples", "--arms", "sft", "bon", "--out", str(out)]
    assert main([*argv, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["seeds"] == [0, 1] and "rft" not in rep["arms"]
    assert (out / "run0-seed0" / "controls.json").is_file()
    assert (out / "run1-seed1" / "README.md").is_file()
    rl = [r["arms"]["rl"]["accuracy"] for r in rep["runs"]]
    assert rep["arms"]["rl"]["per_run"] == rl
    for name in ("sft", "bon", "start"):
        other = [r["arms"][name]["accuracy"] for r in rep["runs"]]
        d = [a - b for a, b in zip(rl, other, strict=True)]
        mean = (d[0] + d[1]) / 2
        half = 12.706204736174698 * abs(d[0] - d[1]) / 2**0.5 / 2**0.5  # t_{.975,1}·s/√2
        p = rep["paired"][name]
        assert p["n"] == 2 and p["mean"] == pytest.approx(mean, abs=1e-12)
        if half > 0:
            assert (p["lo"], p["hi"]) == pytest.approx((mean - half, mean + half), abs=1e-12)
    assert "paired over runs" in (out / "README.md").read_text()
    # several runs without --out: one line
    assert main(["controls", *runs]) == 2
    assert "--out" in capsys.readouterr().err

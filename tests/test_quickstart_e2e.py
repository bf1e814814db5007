"""End to end: `rlhflab quickstart --fast` through the CLI, as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_quickstart_fast_end_to_end(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlhflab.cli", "quickstart", "--fast", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = list(tmp_path.glob("quickstart-fast-*"))
    results = json.loads((run_dir / "final_results.json").read_text())
    for key in ("heldout_accuracy_sft", "heldout_accuracy_rl", "heldout_n", "wall_s"):
        assert key in results, key
    assert (
        0.0 <= results["heldout_accuracy_sft"] <= 1.0
        and 0.0 <= results["heldout_accuracy_rl"] <= 1.0
    )
    assert results["heldout_n"] >= 500
    report = (run_dir / "report.md").read_text()
    assert "after GRPO" in report
    # The healthy run raises no health alarm: no check failed in either stage, no warning line,
    # except `reward_hacking`, which judges the result, not the pipeline: the 80 steps end inside
    # RL's early held-out dip (README), and how deep it is depends on the CPU's kernels (an
    # AMD EPYC AVX2 machine: within the check's margin; an Intel Xeon AVX-512 one: 46.0% after
    # SFT, 34.4% at step 80 while the reward rose, which the check rightly reports). It runs.
    for stage in ("sft", "grpo"):
        failed = dict(results["health"][stage]["failed"])
        failed.pop("reward_hacking", None)
        assert not failed, failed
        assert results["health"][stage]["checked"]
    assert "reward_hacking" in results["health"]["grpo"]["checked"]
    alarms = [line for line in proc.stderr.splitlines() if line.startswith("health: '")]
    assert all(line.startswith("health: 'reward_hacking' failed") for line in alarms), alarms
    # it ends with the next useful commands, on its own models
    assert f"next: rlhflab eval {results['model_dir']} --task " in proc.stderr
    assert f"rlhflab train configs/pg/rloo.yaml model.name_or_path={results['sft_run']}/model" in (
        proc.stderr
    )
    assert "checks passed" in report
    grpo = Path(results["grpo_run"])
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "samples.jsonl",
        "final_results.json",
        "model/config.json",
    ):
        assert (grpo / name).exists(), name
    assert (grpo / "plots" / "reward.png").exists()
    rows = [json.loads(line) for line in (grpo / "metrics.jsonl").read_text().splitlines()]
    assert any("rollout/reward_mean" in r for r in rows)

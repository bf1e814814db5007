"""What `rlhflab train` prints: a few summary lines (the JSON stays in final_results.json), plain
progress lines outside a terminal, and no transformers progress bars or FutureWarnings that the
user cannot act on."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import yaml

from rlhflab.quiet import quiet_transformers
from rlhflab.summary import summary_lines

SFT = {
    "trainer": "sft",
    "model": {
        "build": {"size": "tiny", "vocab_size": 300, "max_position_embeddings": 64,
                  "tokenizer_texts": 300}
    },
    "task": {"name": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
             "max_digits": 1}, "n_train": 300, "n_heldout": 8, "seed": 0,
             "answer_format": "plain"},
    "train": {"steps": 4, "batch_size": 8, "micro_batch_size": 8, "max_len": 48},
    "optim": {"lr": 1e-3},
    "eval": {"n": 8, "max_new_tokens": 4},
    "health": {"window": 3},
    "tracking": {"log_every": 2},
    "precision": {"threads": 1},
}  # fmt: skip


def test_summary_lines_from_results():
    r = {
        "trainer": "sft",
        "steps": 130,
        "final_loss": 0.60503,
        "heldout_accuracy_before": 0.0,
        "heldout_accuracy": 0.46,
        "heldout_accuracy_stderr": 0.0353,
        "heldout_n": 200,
        "heldout_majority_baseline": 0.02,
        "health": {"ok": True, "failed": {}, "checked": ["a", "b", "c"]},
        "wall_s": 95.4,
        "run_dir": "runs/sft-1",
        "model_dir": "runs/sft-1/model",
    }
    assert summary_lines(r) == [
        "sft finished: 130 steps in 0:01:35, final loss 0.605",
        "held-out accuracy: 46.0% ± 3.5 (n=200; before training 0.0%; "
        "majority-answer baseline 2.0%)",
        "health: all 3 checks passed",
        "run directory: runs/sft-1 (final_results.json, metrics.jsonl, plots/, model/)",
    ]
    failed = {"ok": False, "checked": ["a", "b"], "failed": {"b": {"first_step": 3, "count": 2}}}
    stopped = {"trainer": "reward_model", "status": "stopped_by_health", "steps": 3,
               "final_loss": float("nan"), "health": failed, "checkpoint": "c/3",
               "stopped_by": {"check": "b", "step": 3, "detail": "value 0"}}  # fmt: skip
    assert summary_lines(stopped) == [
        "reward_model stopped by a health check: 3 steps",
        "stopped by: b at step 3: value 0; resume from c/3 with --resume",
        "health: 1 of 2 checks failed: b (first at step 3, 2 steps) (docs/health.md)",
    ]


def test_quiet_transformers_keeps_warnings_and_restores_settings():
    # no warning is hidden: a deprecation in how rlhflab calls transformers is fixed at the call
    # (tests/rollout/test_cache_api.py), not filtered
    from transformers.utils import logging as hf_logging

    before = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled())
    msgs = ["`past_key_values` is deprecated and will be removed", "my own deprecation"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_transformers():
            assert not hf_logging.is_progress_bar_enabled()
            for msg in msgs:
                warnings.warn(msg, FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == msgs
    assert (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()) == before


def test_train_prints_a_summary_and_progress_lines_off_a_terminal(tmp_path):
    # A pipe, as in CI or under nohup: stdout and stderr are not terminals.
    cfg = {**SFT, "run": {"name": "sft", "root": str(tmp_path)}}
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [sys.executable, "-m", "rlhflab", "train", str(path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = tmp_path.glob("sft-*")
    final = json.loads((run_dir / "final_results.json").read_text())
    stdout = out.stdout.strip().splitlines()
    assert 3 <= len(stdout) <= 6 and not any(line.startswith(("{", "}")) for line in stdout)
    assert stdout[0].startswith("sft finished: 4 steps in ")
    acc, se = 100 * final["heldout_accuracy"], 100 * final["heldout_accuracy_stderr"]
    assert any(line.startswith(f"held-out accuracy: {acc:.1f}% ± {se:.1f} (n=8") for line in stdout)
    assert f"health: all {len(final['health']['checked'])} checks passed" in stdout
    assert stdout[-1].startswith(f"run directory: {run_dir} (")
    # one progress line per logging interval (steps 2 and 4) and per evaluation (0 and 4)
    progress = [line for line in out.stderr.splitlines() if line.startswith("sft step ")]
    assert [line.split()[2] for line in progress] == ["0/4", "2/4", "4/4", "4/4"]
    for noise in ("Writing model shards", "Loading weights", "FutureWarning", "past_key_values"):
        assert noise not in out.stderr, noise
    assert Path(final["model_dir"]).is_dir()


def test_quiet_transformers_does_not_import_transformers_and_applies_on_import(tmp_path):
    # A command that fails on its config stays fast: quieting imports neither transformers nor
    # torch; imported later inside the context, transformers gets the quiet settings at once.
    (tmp_path / "bad.yaml").write_text("trainer: sft\nbogus: 1\n")
    code = (
        "import sys\n"
        "from rlhflab.cli import main\n"
        f"assert main(['train', {str(tmp_path / 'bad.yaml')!r}]) == 2\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
        "from rlhflab.quiet import quiet_transformers\n"
        "with quiet_transformers():\n"
        "    from transformers.utils import logging as hf_logging\n"
        "    print(hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity())\n"
        "print(hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity())\n"
    )
    drop = ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")  # transformers' defaults
    env = {k: v for k, v in os.environ.items() if k not in drop}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["[]", "False 40", "True 30"]  # ERROR, then WARNING

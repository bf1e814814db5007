"""Bad input is one clear line naming the field, file or row, before the run directory exists;
never a traceback from deep inside a library, never a silent fallback (issue: hostile and careless
use). Runs are tiny models built from scratch (seconds each)."""

import copy
import hashlib
import json
import shutil
import sys
import types
from pathlib import Path

import pytest
from test_checkpoint_resume import BUILD, TASK, sft_raw

from rlhflab.checkpoint import COMMITTED, MANIFEST, committed_checkpoints, load_checkpoint
from rlhflab.cli import main
from rlhflab.config import config_from_dict
from rlhflab.errors import CheckpointError, ConfigError, DataError
from rlhflab.trainers import run_config

ROOT = Path(__file__).resolve().parents[1]


def pg_raw(root, **extra):
    raw = {
        "trainer": "policy_gradient",
        "model": {"build": BUILD},
        "task": TASK,
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "train": {"steps": 1, "micro_batch_size": 4},
        "eval": {"n": 0},
        "precision": {"threads": 1},
        "tracking": {"console": False},
        "run": {"name": "pg", "root": str(root)},
    }
    raw.update(extra)
    return raw


def _nothing_written(root: Path) -> None:
    assert not root.exists() or not any(root.iterdir()), "a run directory was left behind"


# -- 12. Optional trackers ------------------------------------------------------------------------


@pytest.mark.parametrize("sink", ["wandb", "tensorboard"])
def test_missing_tracker_package_is_named_before_the_run_directory(tmp_path, monkeypatch, sink):
    monkeypatch.setitem(sys.modules, sink, None)  # as if not installed
    raw = sft_raw(tmp_path / "runs")
    raw["tracking"] = {"console": False, sink: True}
    with pytest.raises(ConfigError, match=rf"tracking\.{sink}: .*pip install 'rlhflab\[{sink}\]'"):
        run_config(config_from_dict(raw))
    _nothing_written(tmp_path / "runs")


# -- 13. Reward components are validated before the run directory ----------------------------------


def test_overlong_cache_beyond_the_budget_is_a_config_error():
    comps = [{"name": "correctness"}, {"name": "overlong", "args": {"cache": 8}}]
    with pytest.raises(ConfigError, match=r"reward\.components\[overlong\]\.args\.cache .* 1\.\.4"):
        config_from_dict(pg_raw("runs", reward={"components": comps}))


def test_missing_reward_model_path_is_named_before_the_run_directory(tmp_path):
    path = str(tmp_path / "no-such-rm")
    comps = [{"name": "reward_model", "args": {"path": path}}]
    with pytest.raises(ConfigError, match=r"reward\.components\[reward_model\]\.args\.path: cann"):
        run_config(config_from_dict(pg_raw(tmp_path / "runs", reward={"components": comps})))
    _nothing_written(tmp_path / "runs")


# -- 14. The model's context is enforced (DPO) ----------------------------------------------------


def _dpo_raw(tmp_path, rows, heldout_pairs=1):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "trainer": "direct_alignment",
        "model": {"build": BUILD},  # 64 positions
        "task": TASK,
        "data": {
            "source": "file",
            "path": str(path),
            "format": "pairs",
            "heldout_pairs": heldout_pairs,
        },
        "loss": {"name": "dpo", "args": {"beta": 0.1}},
        "train": {"steps": 1, "batch_size": 2, "micro_batch_size": 2},
        "eval": {"n": 0},
        "precision": {"threads": 1},
        "tracking": {"console": False},
        "run": {"name": "dpo", "root": str(tmp_path / "runs")},
    }


def test_dpo_rows_longer_than_the_context_are_an_error(tmp_path):
    rows = [
        {"prompt": f"{i} + 1 =", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(4)
    ]
    rows[2]["prompt"] = "1 + 1 + " * 40 + "1 ="  # far beyond 64 positions
    raw = _dpo_raw(tmp_path, rows)
    with pytest.raises(DataError, match=r"row \d has \d+ tokens > the model's context length 64"):
        run_config(config_from_dict(raw))
    _nothing_written(tmp_path / "runs")


def test_dpo_heldout_pairs_not_smaller_than_the_data_is_an_error(tmp_path):
    rows = [
        {"prompt": f"{i} + 1 =", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(4)
    ]
    with pytest.raises(DataError, match=r"data\.heldout_pairs \(4\) must be smaller than the 4"):
        run_config(config_from_dict(_dpo_raw(tmp_path, rows, heldout_pairs=4)))
    _nothing_written(tmp_path / "runs")


# -- 15. / 16. Values pydantic bounds -------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("train.steps", True, r"train\.steps: must be a number, not true/false"),
        ("optim.lr", True, r"optim\.lr: must be a number, not true/false"),
        ("optim.eps", -1, r"optim\.eps: Input should be greater than 0"),
        ("seed", 2**64, r"seed: Input should be less than or equal to 9223372036854775807"),
        ("task.seed", -1, r"task\.seed: Input should be greater than or equal to 0"),
        ("precision.threads", -1, r"precision\.threads: Input should be greater than or equal"),
    ],
)
def test_out_of_bounds_values_name_the_field(key, value, message):
    raw = copy.deepcopy(sft_raw("runs"))
    *parents, leaf = key.split(".")
    node = raw
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    with pytest.raises(ConfigError, match=message):
        config_from_dict(raw)


def test_run_root_that_is_a_file_is_named(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"run\.root: .* exists and is not a directory"):
        config_from_dict(sft_raw(tmp_path / "file"))


def test_eval_n_beyond_the_heldout_split_says_so(tmp_path):
    raw = sft_raw(tmp_path, steps=1)
    raw["eval"] = {"n": 50, "max_new_tokens": 2}
    with pytest.warns(UserWarning, match=r"eval\.n is 50 but only [0-8] held-out problems exist"):
        res = run_config(config_from_dict(raw))
    assert res["heldout_n"] <= 8


def test_sft_messages_without_a_user_turn_are_an_error(tmp_path):
    path = tmp_path / "sft.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "assistant", "content": "2"},
            ]
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = sft_raw(tmp_path / "runs", steps=1)
    raw["data"] = {"source": "jsonl", "path": str(path)}
    raw["eval"] = {"n": 0}
    with pytest.raises(DataError, match=r"sft\.jsonl line 2: .*no user message"):
        run_config(config_from_dict(raw))
    _nothing_written(tmp_path / "runs")


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_run")
    raw = sft_raw(root, steps=2)
    raw["eval"] = {"n": 0}
    raw["checkpoint"] = {"every": 2}
    return Path(run_config(config_from_dict(raw))["run_dir"])


def _recommit(ck: Path, edit_state=None, edit_manifest=None) -> None:
    """Rewrite a checkpoint's state.json / manifest and re-commit it with matching hashes."""
    manifest = json.loads((ck / MANIFEST).read_text())
    if edit_state:
        state = json.loads((ck / "state.json").read_text())
        edit_state(state)
        data = json.dumps(state).encode()
        (ck / "state.json").write_bytes(data)
        manifest["files"]["state.json"] = {
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    if edit_manifest:
        edit_manifest(manifest)
    (ck / MANIFEST).write_text(json.dumps(manifest))
    digest = hashlib.sha256((ck / MANIFEST).read_bytes()).hexdigest()
    (ck / COMMITTED).write_text(digest + "\n")


def test_forged_state_json_is_refused_naming_the_key(tmp_path, sft_run):
    run = Path(shutil.copytree(sft_run, tmp_path / sft_run.name))
    ck = committed_checkpoints(run)[-1]
    _recommit(ck, edit_state=lambda s: s.pop("stateful"))
    with pytest.raises(CheckpointError, match=r"state\.json stateful: Field required"):
        load_checkpoint(ck)


def test_resuming_another_trainers_checkpoint_is_refused(tmp_path, sft_run):
    raw = pg_raw(sft_run.parent)
    raw["run"].update({"name": "sft", "resume": str(sft_run), "allow_config_change": True})
    with pytest.raises(ConfigError, match=r"checkpoint of a 'sft' run; this config is a 'policy_"):
        run_config(config_from_dict(raw))


# -- 17. CLI arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "m", "--task", "chain_sum", "--task-config", "{bad json"], "not valid JSON"),
        (["eval", "m", "--task", "chain_sum", "--batch-size", "0"], "--batch-size: must be >= 1"),
        (["eval", "m", "--task", "chain_sum", "--n", "0"], "--n: must be >= 1, got 0"),
        (["eval", "m", "--task", "chain_sum", "--temperature", "0", "--k", "2"], "temperature > 0"),
        (["best-of-n", "p", "--rm", "x:orm", "--task", "t", "--n", "a,b"], "'a' is not an integer"),
    ],
)
def test_bad_cli_arguments_are_one_line(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


# -- 18. Messages that name the real cause ---------------------------------------------------------


def test_generation_budget_beyond_the_context_names_max_new_tokens(tmp_path):
    raw = pg_raw(tmp_path / "runs")
    raw["rollout"]["max_new_tokens"] = 100
    with pytest.raises(ConfigError, match=r"rollout\.max_new_tokens \(100\) must be smaller than "
                       r"the model's context length \(64\)"):  # fmt: skip
        run_config(config_from_dict(raw))
    _nothing_written(tmp_path / "runs")


def test_checkpoint_of_another_version_warns_with_both_versions(tmp_path, sft_run):
    import torch

    import rlhflab

    run = Path(shutil.copytree(sft_run, tmp_path / sft_run.name))
    # Without its final results the run's end is redone (a complete run's resume does nothing).
    (run / "final_results.json").unlink()
    ck = committed_checkpoints(run)[-1]
    _recommit(ck, edit_manifest=lambda m: m["versions"].update({"rlhflab": "0.0.1"}))
    raw = sft_raw(tmp_path, steps=2)
    raw["eval"] = {"n": 0}
    raw["checkpoint"] = {"every": 2}
    raw["run"]["resume"] = str(run)
    with pytest.warns(UserWarning) as record:
        run_config(config_from_dict(raw))
    notes = [str(w.message) for w in record if "was written by" in str(w.message)]
    assert notes == [
        f"warning: checkpoint step-00000002 was written by rlhflab 0.0.1 "
        f"(now {rlhflab.__version__}); resume may not be exact"
    ]
    assert torch.__version__  # the torch version is named too when it differs (same here)


# -- 19. Secrets in every stream ------------------------------------------------------------------

SECRET = "canary-secret-5521aa"


def test_wandb_is_handed_the_redacted_config(tmp_path, monkeypatch):
    from rlhflab.tracking import Tracker

    seen = {}
    fake = types.SimpleNamespace(init=lambda **kw: seen.update(kw) or fake, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    cfg = config_from_dict(sft_raw(tmp_path) | {"tracking": {"console": False, "wandb": True}})
    cfg.task.system = f"use {SECRET}"
    Tracker.for_run(tmp_path, cfg, headline=()).close()
    assert seen["config"]["task"]["system"] == "use ***"
    assert SECRET not in json.dumps(seen)


def test_results_and_tracebacks_on_the_console_are_redacted(tmp_path, monkeypatch, capsys):
    import rlhflab.trainers

    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.setattr(rlhflab.trainers, "run_config", lambda cfg: {"run_dir": cfg.run.root})
    sft = str(ROOT / "configs/sft/tiny_scratch.yaml")
    assert main(["train", sft, f"run.root=/data/{SECRET}"]) == 0
    out = capsys.readouterr().out  # the summary lines (the JSON is in final_results.json)
    assert "run directory: /data/*** (" in out and SECRET not in out

    def boom(cfg):
        raise RuntimeError(f"unexpected failure near {SECRET}")

    monkeypatch.setattr(rlhflab.trainers, "run_config", boom)
    assert main(["train", sft]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "unexpected failure near ***" in err and SECRET not in err

    def missing(cfg):
        raise FileNotFoundError(2, "No such file or directory", f"/data/{SECRET}/x.jsonl")

    monkeypatch.setattr(rlhflab.trainers, "run_config", missing)
    assert main(["train", sft]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: [Errno 2] No such file or directory: '/data/***/x.jsonl'"]

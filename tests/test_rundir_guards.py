"""A run directory under hostile or careless use: concurrent runs, resume by name, abandoned
timelines, changed data, numeric secrets, symlinks, config changes, damaged logs, a full disk.
Runs are tiny SFT runs (seconds each)."""

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from test_checkpoint_resume import assert_same_run, metrics, run_cli, run_dir_of, sft_raw

from rlhflab.checkpoint import (
    Checkpointer,
    committed_checkpoints,
    find_resume_checkpoint,
    load_checkpoint,
)
from rlhflab.config import config_from_dict
from rlhflab.errors import CheckpointError, ConfigError, DataError, DiskFullError
from rlhflab.rundir import LOCK, lock_run_dir, release_locks
from rlhflab.tracking import Tracker
from rlhflab.trainers import run_config


def sft(root, *, steps=6, resume=None, **extra):
    raw = sft_raw(root, steps=steps)
    raw["checkpoint"] = {"every": 2, "keep_last": None}
    raw["eval"] = {"n": 0}
    if resume is not None:
        raw["run"]["resume"] = str(resume)
    for k, v in extra.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v
    return raw


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A finished 6-step SFT run with committed checkpoints at steps 2, 4 and 6."""
    root = tmp_path_factory.mktemp("base")
    return Path(run_config(config_from_dict(sft(root)))["run_dir"])


def _copy(run: Path, root: Path, name: str | None = None) -> Path:
    dst = root / (name or run.name)
    shutil.copytree(run, dst, symlinks=True)
    return dst


def _snapshot(run: Path) -> dict:
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != LOCK
    }


# -- 1. One process per run directory ---------------------------------------------------------


def _hold_lock(run: Path) -> subprocess.Popen:
    code = (
        "import sys, time; from rlhflab.rundir import lock_run_dir; "
        "lock_run_dir(sys.argv[1]); print('locked', flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_process_on_a_run_directory_is_refused_naming_the_holder(tmp_path, base):
    run = _copy(base, tmp_path)
    holder = _hold_lock(run)
    try:
        before = _snapshot(run)
        with pytest.raises(ConfigError, match=rf"in use by process {holder.pid} \(lock "):
            run_config(config_from_dict(sft(tmp_path, steps=8, resume=run, run={"name": "sft",
                "allow_config_change": True})))  # fmt: skip
        assert _snapshot(run) == before  # nothing truncated, nothing appended
    finally:
        holder.kill()
        holder.wait()
    # The holder died without releasing anything: its lock is stale and is taken over.
    assert (run / LOCK).read_text().strip() == str(holder.pid)
    lock_run_dir(run)
    try:
        assert (run / LOCK).read_text().strip() == str(os.getpid())
    finally:
        release_locks()


def test_lock_is_released_after_a_run_and_taken_by_a_fresh_run(tmp_path, base):
    run = _copy(base, tmp_path)
    run_config(config_from_dict(sft(tmp_path, resume=run)))  # a finished run: no step redone
    holder = _hold_lock(run)  # another process can lock it now: the run released it
    holder.kill()
    holder.wait()


# -- 2. --resume by name matches the name exactly ----------------------------------------------


def test_resume_by_name_never_picks_a_run_whose_name_extends_it(tmp_path, base):
    other = _copy(base, tmp_path, "exp-b-20261123-120000")
    with pytest.raises(ConfigError, match="no committed checkpoint of a run named 'exp'"):
        find_resume_checkpoint("latest", str(tmp_path), "exp")
    own = _copy(base, tmp_path, "exp-20261122-090000-1")
    newer = time.time() + 100
    for ck in committed_checkpoints(other):
        os.utime(ck, (newer, newer))  # exp-b's checkpoints are the newest on disk
    ck = find_resume_checkpoint("latest", str(tmp_path), "exp")
    assert ck.run_dir == own and ck.step == 6


# -- 3. Resume follows the timeline that was resumed --------------------------------------------


def test_resume_from_older_checkpoint_then_killed_then_plain_resume(tmp_path, base):
    run = _copy(base, tmp_path)
    raw = sft(tmp_path, resume=committed_checkpoints(run)[0])  # step 2
    proc = run_cli(tmp_path, raw, fault="step_end@3=sigkill", check=False)
    assert proc.returncode == -9, proc.stderr[-1000:]
    # The abandoned timeline (steps 4 and 6) is gone before step 3 was even trained.
    assert [p.name for p in committed_checkpoints(run)] == ["step-00000002"]
    run_config(config_from_dict(sft(tmp_path, resume="latest")))
    assert [r["step"] for r in metrics(run) if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
    assert_same_run(base, run)


# -- 4. A fingerprint of the training data --------------------------------------------------------


def _jsonl_sft(tmp_path, rows, **extra):
    raw = sft(tmp_path / "runs", steps=4, **extra)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw["data"] = {"source": "jsonl", "path": str(path)}
    raw["train"]["batch_size"] = 4
    return raw


def test_resume_on_changed_data_is_refused_or_explicitly_allowed(tmp_path):
    rows = [{"prompt": f"{i} + 1 =", "completion": str(i + 1)} for i in range(12)]
    raw = _jsonl_sft(tmp_path, rows)
    raw["checkpoint"]["every"] = 2
    proc = run_cli(tmp_path, raw, fault="step_end@3=sigkill", check=False)
    assert proc.returncode == -9
    run = run_dir_of(tmp_path / "runs", "sft")
    before = _snapshot(run)
    raw = _jsonl_sft(tmp_path, rows[:5], run={"resume": "latest"})  # rows removed
    with pytest.raises(DataError, match=r"training data changed since the checkpoint: 12 rows"):
        run_config(config_from_dict(raw))
    assert _snapshot(run) == before
    raw["run"]["allow_config_change"] = True
    with pytest.warns(UserWarning, match=r"12 rows .* then, 5 rows .* now; continuing with a new"):
        res = run_config(config_from_dict(raw))
    assert res["steps"] == 4 and res["examples"] == 5


# -- 5. Redaction touches string values only ------------------------------------------------------


def test_numeric_secret_never_corrupts_metrics_or_state(tmp_path, monkeypatch):
    random.seed(0)
    rng_int = str(random.getstate()[1][7])
    secret = rng_int[:9]  # digits that occur inside the python RNG state
    loss = float(f"0.{secret}1")  # and inside a logged loss
    monkeypatch.setenv("MY_API_TOKEN", secret)
    tracker = Tracker(tmp_path, total_steps=1, console_enabled=False)
    tracker.log(1, {"train/loss": loss, "note": f"token {secret} in text"})
    tracker.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["train/loss"] == loss and row["note"] == "token *** in text"
    model = torch.nn.Linear(2, 2)
    ck = Checkpointer(tmp_path, {"system": f"key={secret}", "lr": loss}, modules={"model": model},
                      optimizers={}, schedulers={})  # fmt: skip
    random.seed(0)
    saved_rng = random.getstate()
    path = ck.save(1, {"last_loss": loss})
    state = json.loads((path / "state.json").read_text())  # valid JSON
    assert state["trainer"]["last_loss"] == loss and state["config"]["lr"] == loss
    assert state["config"]["system"] == "key=***"
    assert str(state["python_rng"][1][7]) == rng_int
    random.seed(1)
    restorer = Checkpointer(tmp_path, {}, modules={"model": model}, optimizers={}, schedulers={})
    restorer.restore(load_checkpoint(path))
    assert random.getstate() == saved_rng


# -- 6. No writes through symlinks -----------------------------------------------------------------


@pytest.mark.parametrize("what", ["metrics.jsonl", "checkpoints"])
def test_symlinks_in_a_run_directory_are_refused(tmp_path, base, what):
    run = _copy(base, tmp_path / "runs")
    outside = tmp_path / "outside"
    if what == "metrics.jsonl":
        outside.write_bytes(b"v" * 9000)  # a victim file outside the runs root
        (run / what).unlink()
    else:
        shutil.move(run / what, outside)
    (run / what).symlink_to(outside)
    victim = _snapshot(outside) if outside.is_dir() else outside.read_bytes()
    with pytest.raises(ConfigError, match=re.escape(f"{what} is a symlink (to {outside})")):
        run_config(config_from_dict(sft(tmp_path / "runs", steps=8, resume=run,
                                        run={"allow_config_change": True})))  # fmt: skip
    assert (_snapshot(outside) if outside.is_dir() else outside.read_bytes()) == victim


# -- 7. A config change on resume is recorded ------------------------------------------------------


def test_allowed_config_change_is_recorded_and_config_yaml_updated(tmp_path, base):
    run = _copy(base, tmp_path)
    raw = sft(tmp_path, steps=8, resume=run, run={"allow_config_change": True},
              optim={"lr": 2e-3})  # fmt: skip
    run_config(config_from_dict(raw))
    rows = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    assert rows[0]["step"] == 6 and rows[0]["from_checkpoint"] == "step-00000006"
    assert rows[0]["changes"] == {
        "optim.lr": [1e-3, 2e-3],
        "run.root": [str(base.parent), str(tmp_path)],  # the run was moved: recorded too
        "train.steps": [6, 8],
    }
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["train"]["steps"] == 8 and saved["optim"]["lr"] == 2e-3


# -- 8. Damaged logs are detected before resuming ----------------------------------------------------


@pytest.mark.parametrize(
    "damage, message",
    [
        ("garbage", r"metrics\.jsonl line 3: not valid JSON"),
        ("lost", r"metrics\.jsonl: \d+ bytes, but checkpoint step-00000006 recorded \d+: lines"),
    ],
)
def test_damaged_metrics_are_refused_naming_file_and_line(tmp_path, base, damage, message):
    run = _copy(base, tmp_path)
    f = run / "metrics.jsonl"
    lines = f.read_text().splitlines(keepends=True)
    if damage == "garbage":
        lines[2] = "\x00" * (len(lines[2]) - 1) + "\n"  # same size, garbage bytes
        f.write_text("".join(lines))
    else:
        f.write_text("".join(lines[:-2]))
    before = _snapshot(run)
    with pytest.raises(CheckpointError, match=message):
        run_config(config_from_dict(sft(tmp_path, resume=run)))
    assert _snapshot(run) == before


# -- 9. Disk full during a checkpoint ----------------------------------------------------------------


def test_disk_full_during_checkpoint_is_one_line_and_resume_works(tmp_path, base, monkeypatch):
    monkeypatch.setenv(
        "RLHFLAB_FAULT", "checkpoint_file@13=enospc"
    )  # 2nd file of step 4's (11 each)
    (tmp_path / "runs").mkdir()
    with pytest.raises(DiskFullError) as err:
        run_config(config_from_dict(sft(tmp_path / "runs")))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("disk full writing checkpoint file ")
    assert ".tmp-step-00000004-" in msg and "bytes free, a checkpoint needs about" in msg
    need = int(msg.split("needs about ")[1].split()[0])
    run = run_dir_of(tmp_path / "runs", "sft")
    step2 = committed_checkpoints(run)[0]
    assert need == sum(p.stat().st_size for p in step2.iterdir())
    assert [p.name for p in committed_checkpoints(run)] == ["step-00000002"]
    assert not list((run / "checkpoints").glob(".tmp-*"))
    monkeypatch.delenv("RLHFLAB_FAULT")
    run_config(config_from_dict(sft(tmp_path / "runs", resume="latest")))
    assert_same_run(base, run)


def _mount_tmpfs(mnt: Path, size: str) -> None:
    mnt.mkdir()
    if (
        shutil.which("mount") is None
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True
        ).returncode
    ):
        pytest.skip("cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN)")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs (room for one checkpoint of the tiny SFT model, not two); skipped where
    mounting is not allowed."""
    _mount_tmpfs(tmp_path / "mnt", "2m")
    try:
        yield tmp_path / "mnt"
    finally:
        subprocess.run(["umount", "-l", str(tmp_path / "mnt")], check=False)


def test_read_only_run_root_is_one_line_fresh_and_resume(tmp_path, base):
    mnt = tmp_path / "ro"
    _mount_tmpfs(mnt, "8m")
    try:
        run = _copy(base, mnt)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(ConfigError, match=r"run\.root: cannot create a run directory under .*"
                           "Read-only file system"):  # fmt: skip
            run_config(config_from_dict(sft(mnt / "new")))
        with pytest.raises(ConfigError, match=r"cannot write its lock .*: Read-only file system"):
            run_config(config_from_dict(sft(mnt, resume=run)))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.slow
def test_disk_full_on_a_real_tmpfs_then_resume_after_freeing_space(base, small_tmpfs):
    raw = sft(small_tmpfs / "runs")
    raw["run"]["save_model"] = False
    with pytest.raises(DiskFullError) as err:  # safetensors' own ENOSPC error, recognised
        run_config(config_from_dict(raw))
    assert str(err.value).startswith("disk full writing checkpoint file ")
    assert ".tmp-step-00000004-" in str(err.value) and "\n" not in str(err.value)
    run = run_dir_of(small_tmpfs / "runs", "sft")
    assert [p.name for p in committed_checkpoints(run)] == ["step-00000002"]
    assert not list((run / "checkpoints").glob(".tmp-*"))
    subprocess.run(["mount", "-o", "remount,size=20m", str(small_tmpfs)], check=True)  # freed
    raw["run"]["resume"] = "latest"
    run_config(config_from_dict(raw))
    assert metrics(run) == metrics(base)

"""Launch faults under torchrun (2 processes, gloo on CPU): the launcher killed with SIGKILL takes
its workers down (no orphan keeps training) and leaves the last committed checkpoint intact; under
`rlhflab train --nproc 2` a user error (a config error, refused before torchrun starts; an error
only the ranks see; a refusal by rank 0 alone, the run directory locked by another process; the
same error in both ranks) is one line, printed once, exit code 2, with no traceback and no rank
left waiting in a collective ("[gloo] Connection closed by peer").

Six launches in all (~10-40 s each), so the tests are marked slow (CI runs them).
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from factories import tiny_task

from rlhflab.checkpoint import committed_checkpoints, load_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)"),
]

TASK = tiny_task(n_train=64, n_heldout=8)


def _raw(root: Path) -> dict:
    """A tiny from-scratch SFT run far too long to finish: it is killed, or refused."""
    return {
        "trainer": "sft",
        "model": {
            "build": {
                "size": "tiny",
                "vocab_size": 300,
                "max_position_embeddings": 64,
                "tokenizer_texts": 100,
            }
        },
        "task": TASK,
        "precision": {"threads": 1},
        "tracking": {"console": False},
        "train": {"steps": 100000, "batch_size": 8, "micro_batch_size": 4, "max_len": 48},
        "optim": {"lr": 1e-3},
        "eval": {"n": 0},
        "checkpoint": {"every": 3, "keep_last": 2},
        "parallel": {"timeout_s": 120},
        "run": {"name": "sft", "root": str(root)},
    }


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLHFLAB_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _torchrun(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=2", "-m", "rlhflab", *args]  # fmt: skip


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> dict:
    """A 2-rank run whose torchrun launcher is killed with SIGKILL once training has committed a
    checkpoint; what became of its workers."""
    tmp = tmp_path_factory.mktemp("launch")
    cfg = tmp / "sft.yaml"
    cfg.write_text(yaml.safe_dump(_raw(tmp / "runs")))
    log = (tmp / "torchrun.log").open("w")
    launcher = subprocess.Popen(
        _torchrun(["train", str(cfg)]), env=_env(), stdout=log, stderr=subprocess.STDOUT
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and launcher.poll() is None:
            runs = list((tmp / "runs").glob("sft-*"))
            if runs and len(committed_checkpoints(runs[0])) >= 2:
                break
            time.sleep(0.2)
        assert launcher.poll() is None, (tmp / "torchrun.log").read_text()[-3000:]
        workers = [p for p in _children(launcher.pid) if b"rlhflab" in _cmdline(p)]
        assert len(workers) == 2, workers  # torchrun's agent is the workers' parent
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 15 and any(_alive(p) for p in workers):
            time.sleep(0.1)
        left = [p for p in workers if _alive(p)]
        return {"run": runs[0], "cfg": cfg, "left": left, "exit_s": time.monotonic() - t0}
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in workers:  # never leave an orphan behind, whatever the outcome
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        t1 = time.monotonic()
        while time.monotonic() - t1 < 10 and any(_alive(p) for p in workers):
            time.sleep(0.1)  # gone, and their lock of the run directory with them
        log.close()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_sigkill_of_the_launcher_takes_its_workers_down(killed):
    # Before: both workers went on training, orphaned, until their 100000 steps were done.
    assert killed["left"] == [], f"workers still running {killed['exit_s']:.1f} s after"
    last = committed_checkpoints(killed["run"])[-1]
    ckpt = load_checkpoint(last)  # verifies every file against the manifest
    assert ckpt.step >= 3 and ckpt.state["world_size"] == 2


def _rlhflab_nproc2(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """`rlhflab <args> --nproc 2`, run to its end; its exit code and output."""
    cmd = [sys.executable, "-m", "rlhflab", *args, "--nproc", "2"]
    return subprocess.run(
        cmd, env=env or _env(), capture_output=True, text=True, timeout=240, check=False
    )


def _assert_one_line_error(res: subprocess.CompletedProcess, reason: str) -> None:
    """Exit code 2 and `reason` once, the only `error:` line: no traceback (a worker's or the
    launcher's), no second copy, no "rank N:" prefix, nothing of torchrun's failure report or
    banners (its log lines name their source as torch/distributed/...). Whatever the install
    path holds; other lines (a library's warning about this machine) are allowed."""
    err = res.stderr
    assert res.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert [x for x in err.splitlines() if x.startswith("error:")] == [reason], err[-3000:]
    assert err.count(reason) == 1, err[-3000:]
    assert "rank 0: " not in err and "rank 1: " not in err, err[-3000:]
    assert "Connection closed by peer" not in err, err[-3000:]  # no rank left in a collective
    for torchrun_says in ("torch/distributed/", "ChildFailedError", "exitcode", "OMP_NUM_THREADS"):
        assert torchrun_says not in err, err[-3000:]


def test_locked_run_dir_refusal_is_one_line_printed_once(killed):
    run = killed["run"]
    fd = os.open(run / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # "another process" holds the run
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        res = _rlhflab_nproc2(["train", str(killed["cfg"]), "--resume", str(run)])
    finally:
        os.close(fd)
    reason = (
        f"error: run directory {run} is in use by process {os.getpid()} (lock {run / '.lock'}); "
        "wait for it to finish or stop it first"
    )
    # Before: rank 1 went on alone and died in its first collective with a traceback ("Connection
    # closed by peer"); later, torchrun's 41-line ChildFailedError traceback and exit code 1.
    _assert_one_line_error(res, reason)


def test_config_error_under_nproc_is_one_line_exit_2(tmp_path):
    """A config error is refused by `rlhflab train --nproc 2` itself, before torchrun starts."""
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(yaml.safe_dump(_raw(tmp_path / "runs")))
    res = _rlhflab_nproc2(["train", str(cfg), "train.bogus=1"])
    # Before: rank 0's line, then torchrun's ChildFailedError traceback, exit code 1.
    _assert_one_line_error(res, f"error: {cfg}: unknown config key 'train.bogus'")
    assert not (tmp_path / "runs").exists()


def test_user_error_inside_the_ranks_is_one_line_exit_2(tmp_path):
    """An error only the ranks see (a data file, read once training starts) under a real 2-rank
    launch: the ranks exit 2 after rank 0's one line; the launcher adds nothing."""
    raw = _raw(tmp_path / "runs")
    missing = tmp_path / "missing.jsonl"
    raw["data"] = {"source": "jsonl", "path": str(missing)}
    raw["train"]["steps"] = 2
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in _env().items() if k != "OMP_NUM_THREADS"}  # as most users run it
    res = _rlhflab_nproc2(["train", str(cfg)], env=env)
    # Before: torchrun's banner about OMP_NUM_THREADS (5 lines), that line, then torchrun's
    # ChildFailedError traceback, exit code 1.
    _assert_one_line_error(res, f"error: data.path: file not found: {missing}")


def test_the_same_error_in_both_ranks_is_printed_once(tmp_path):
    """A NaN loss at step 2 in both ranks (after the first collectives): each rank records its
    line in its torchelastic error file, the launcher prints the first once."""
    raw = _raw(tmp_path / "runs")
    raw["train"]["steps"] = 3
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    res = _rlhflab_nproc2(["train", str(cfg)], env={**_env(), "RLHFLAB_FAULT": "loss@2=nan"})
    # Before: "rank 1: error: ..." and "rank 0: error: ...", one line from each rank.
    err = res.stderr
    assert res.returncode == 2 and "Traceback" not in err, err[-3000:]
    errors = [x for x in err.splitlines() if "error:" in x]
    assert len(errors) == 1, err[-3000:]
    assert re.fullmatch(
        r"rank [01]: error: step 2: train/loss is nan; stopped before the optimizer step "
        r"\(train\.nan_policy: raise\)",
        errors[0],
    ), err[-3000:]


def test_sigkill_of_rlhflab_nproc_takes_torchrun_and_workers_down(tmp_path):
    """`rlhflab train --nproc 2` starts torchrun as its child; killing rlhflab with SIGKILL
    (which it cannot forward) stops torchrun and its workers too."""
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(yaml.safe_dump(_raw(tmp_path / "runs")))
    log = (tmp_path / "rlhflab.log").open("w")
    cmd = [sys.executable, "-m", "rlhflab", "train", str(cfg), "--nproc", "2"]
    top = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    procs: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and top.poll() is None:
            runs = list((tmp_path / "runs").glob("sft-*"))
            if runs and len(committed_checkpoints(runs[0])) >= 1:
                break
            time.sleep(0.2)
        assert top.poll() is None, (tmp_path / "rlhflab.log").read_text()[-3000:]
        agents = _children(top.pid)
        assert len(agents) == 1, agents  # torchrun
        procs = agents + _children(agents[0])
        assert len(procs) == 3, procs  # torchrun and its two workers
        top.send_signal(signal.SIGKILL)
        top.wait()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20 and any(_alive(p) for p in procs):
            time.sleep(0.1)
        # Before: torchrun (and so its workers) went on training, orphaned.
        assert [p for p in procs if _alive(p)] == []
    finally:
        if top.poll() is None:
            top.kill()
        for p in procs:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        log.close()

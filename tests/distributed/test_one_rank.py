"""`rlhflab train --nproc 1` with parallel.strategy ddp / fsdp2: the one rank joins a process
group of one, so a one-GPU machine runs the launched code path (NCCL, FSDP2 sharding, sharded
checkpoints) as `--nproc N` does. Before, WORLD_SIZE=1 always meant "not launched": the run took
the single-process path under torchrun and the launched path could not be reached on one GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhflab import distributed
from rlhflab.cli import main

ROOT = Path(__file__).resolve().parents[2]
SFT = str(ROOT / "configs/sft/tiny_scratch.yaml")


def test_launched_with_one_rank_only_when_the_launcher_asks(monkeypatch):
    monkeypatch.delenv(distributed.ONE_RANK_ENV, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not distributed.launched()  # a bare torchrun with one rank: single-process path
    monkeypatch.setenv(distributed.ONE_RANK_ENV, "1")
    assert distributed.launched()
    monkeypatch.delenv("WORLD_SIZE")  # not under torchrun: the variable alone does nothing
    assert not distributed.launched()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv(distributed.ONE_RANK_ENV)
    assert distributed.launched()


@pytest.mark.parametrize(
    ("strategy", "group"), [("fsdp2", "1"), ("ddp", "1"), ("none", None), ("auto", None)]
)
def test_nproc_1_asks_for_a_group_of_one_with_ddp_or_fsdp2(strategy, group, monkeypatch):
    seen = {}

    def call(cmd, env, **kw):
        seen.update(cmd=cmd, env=env)
        return 0

    monkeypatch.delenv(distributed.ONE_RANK_ENV, raising=False)
    monkeypatch.setattr(subprocess, "call", call)
    assert main(["train", SFT, "--nproc", "1", f"parallel.strategy={strategy}"]) == 0
    assert "--nproc-per-node=1" in seen["cmd"]
    assert seen["env"].get(distributed.ONE_RANK_ENV) == group


@pytest.mark.slow
def test_nproc_1_fsdp2_writes_a_sharded_checkpoint_of_one_rank(tmp_path):
    from factories import tiny_sft, worker_env

    raw = tiny_sft(tmp_path / "runs", checkpoint={"every": 1})
    raw["train"]["steps"] = 1
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "rlhflab", "train", str(cfg), "--nproc", "1"]
    res = subprocess.run([*cmd, "parallel.strategy=fsdp2"], env=worker_env(),
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    (ck,) = (tmp_path / "runs").glob("sft-*/checkpoints/step-00000001")
    assert (ck / "model-rank00000-of-00001.safetensors").is_file()  # the launched path's shards

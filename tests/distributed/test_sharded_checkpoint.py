"""Sharded checkpoints under FSDP2 (torchrun, 2 processes, gloo): each rank writes only its own
shards (per-rank safetensors and a JSON index), and a run resumes from them at another world
size — 2 ranks → 1 process and 1 process → 2 ranks — computing the next steps as the
uninterrupted run does (float64, tolerances of tests/distributed/test_distributed.py). A damaged
shard file is refused naming the file, and so is a shard swapped in from another run of the same
shapes or from a model of another shape, behind a recomputed manifest. The slice arithmetic
itself is unit-tested in tests/test_checkpoint_sharded.py."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from factories import reseal
from safetensors import safe_open
from safetensors.torch import load_file
from test_distributed import (  # noqa: F401 (base_model is a fixture)
    NOT_COMPARED,
    RTOL,
    _grpo,
    _metrics,
    _rlhflab,
    _run_dir,
    _sft,
    _write_cfg,
    base_model,
)

from rlhflab.checkpoint import (
    committed_checkpoints,
    load_checkpoint,
)
from rlhflab.checkpoint.sharded import read_tensors
from rlhflab.errors import CheckpointError

pytestmark = pytest.mark.slow

STEP2 = "checkpoints/step-00000002"
#: Runs take 4 steps and resume from step 2: step 3's loss checks the restored weights, step 4's
#: the restored optimizer state too (through step 3's update).
STEPS = 4
SHARDED_FILES = {
    "model-rank00000-of-00002.safetensors",
    "model-rank00001-of-00002.safetensors",
    "model.shards.json",
    "optimizer-rank00000-of-00002.safetensors",
    "optimizer-rank00001-of-00002.safetensors",
    "optimizer.shards.json",
}


def _config(base: str, tmp: Path) -> Path:
    raw = _sft(base)
    raw["train"]["steps"] = STEPS
    raw["eval"] = {"n": 0}
    return _write_cfg(tmp / "sft.yaml", raw)


def _run(nproc: int, cfg: Path, root: Path, *extra: str) -> Path:
    res = _rlhflab(
        nproc, ["train", str(cfg), f"run.root={root}", "parallel.strategy=fsdp2", *extra]
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return _run_dir(root)


@pytest.fixture(scope="module")
def runs(base_model, tmp_path_factory):  # noqa: F811
    """The same 4-step float64 SFT run with 2 FSDP2 ranks and with 1 process (a checkpoint after
    every step); returns (config, {nproc: run dir})."""
    tmp = tmp_path_factory.mktemp("sharded")
    cfg = _config(base_model, tmp)
    return cfg, {n: _run(n, cfg, tmp / f"runs-{n}") for n in (2, 1)}


def _resume(run: Path, nproc: int, cfg: Path, tmp: Path) -> Path:
    """A copy of `run` resumed from its step-2 checkpoint with `nproc` processes."""
    root = tmp / f"resumed-{nproc}"
    shutil.copytree(run, root / run.name)
    return _run(nproc, cfg, root, "--resume", str(root / run.name / STEP2))


def _assert_next_step_equal(ref: Path, resumed: Path) -> None:
    """Steps 1-2 are the same lines (the log is cut back to the checkpoint); steps 3-4, computed
    after the resume, equal the uninterrupted run's to float64 rounding; so do the weights."""
    m1, m2 = _metrics(ref), _metrics(resumed)
    assert [r["step"] for r in m1] == [r["step"] for r in m2] and m1[-1]["step"] == STEPS
    for r1, r2 in zip(m1, m2, strict=True):
        keys = {k for k in r1 if not k.startswith(NOT_COMPARED)}
        assert keys == {k for k in r2 if not k.startswith(NOT_COMPARED)}
        for k in keys:
            if isinstance(r1[k], int | float) and not isinstance(r1[k], bool):
                assert r2[k] == pytest.approx(r1[k], rel=RTOL, abs=RTOL), (r1["step"], k)
            else:
                assert r2[k] == r1[k], (r1["step"], k)
    assert any(k.endswith("loss") for k in m1[-1]), sorted(m1[-1])
    # Each AdamW step after the resume: a gradient difference δ moves a weight by at most
    # lr·δ/eps_adam; δ <= RTOL·|g|, and no gradient element exceeds the gradient's norm.
    optim = load_checkpoint(ref / STEP2).state["config"]["optim"]
    norms = [max(v for k, v in r.items() if "grad_norm" in k) for r in m1 if r["step"] > 2]
    atol = optim["lr"] / optim["eps"] * RTOL * sum(norms)
    w1 = load_file(ref / "model/model.safetensors")
    w2 = load_file(resumed / "model/model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        assert w1[k].dtype == torch.float64
        torch.testing.assert_close(w2[k], w1[k], atol=atol, rtol=RTOL, msg=k)


def test_each_rank_writes_only_its_own_shards(runs):
    """No gathered file: per-rank files and indexes in the manifest; each rank's file holds its
    FSDP2 shard (ceil(n/2) rows of a dim-0 length n on rank 0, the rest on rank 1), the two
    together every element once; consolidated, the last checkpoint is the final model."""
    _, run = runs
    ck = run[2] / STEP2
    names = {p.name for p in ck.iterdir()}
    assert names >= SHARDED_FILES
    assert not names & {"model.safetensors", "optimizer.safetensors"}
    assert set(load_checkpoint(ck).manifest["files"]) >= SHARDED_FILES
    index = json.loads((ck / "model.shards.json").read_text())
    assert index["world_size"] == 2
    held = {}
    for r in (0, 1):
        fname = f"model-rank{r:05d}-of-00002.safetensors"
        with safe_open(str(ck / fname), framework="pt") as f:
            held[r] = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    total = 0
    for name, t in index["tensors"].items():
        n = t["shape"][0]
        rows = [math.ceil(n / 2), n - math.ceil(n / 2)]
        total += math.prod(t["shape"])
        for r in (0, 1):
            if rows[r]:
                assert held[r][name] == [rows[r], *t["shape"][1:]], (name, r)
            else:
                assert name not in held[r]
    numel = [sum(math.prod(s) for s in held[r].values()) for r in (0, 1)]
    assert sum(numel) == total and max(numel) < total
    full = read_tensors(run[2] / f"checkpoints/step-{STEPS:08d}", "model")
    final = load_file(run[2] / "model/model.safetensors")
    assert sum(t.numel() for t in full.values()) == total
    for k in full.keys() & final.keys():
        assert torch.equal(full[k], final[k]), k
    assert len(full.keys() ^ final.keys()) <= 2  # a tied pair, saved under either name


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate", r"has \d+ bytes, manifest says \d+ \(truncated or modified\)"),
        ("flip", "fails its sha256 check"),
    ],
)
def test_a_damaged_shard_is_refused_naming_the_file(runs, tmp_path, damage, message):
    _, run = runs
    ck = tmp_path / "run" / "checkpoints" / "step-00000002"
    shutil.copytree(run[2] / STEP2, ck)
    shard = ck / "optimizer-rank00001-of-00002.safetensors"
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    else:
        shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match=f"file {shard.name} {message}") as err:
        load_checkpoint(ck)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def other_runs(base_model, tmp_path_factory):  # noqa: F811
    """Two more 2-rank FSDP2 runs of 2 steps: another run of the same model (same shapes,
    another seed) and a run of a model of another shape (built with vocabulary 320, not the
    base's 300)."""
    tmp = tmp_path_factory.mktemp("sharded_other")
    raw = _sft(base_model)
    raw.update(train={**raw["train"], "steps": 2}, eval={"n": 0}, seed=7)
    same = _run(2, _write_cfg(tmp / "same.yaml", raw), tmp / "same")
    build = {"size": "tiny", "vocab_size": 320, "max_position_embeddings": 64,
             "tokenizer_texts": 300}  # fmt: skip
    raw["model"] = {"build": build, "dtype": "float64"}
    other = _run(2, _write_cfg(tmp / "other.yaml", raw), tmp / "other")
    return {"same shapes": same, "another shape": other}


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("same shapes", r"file {f} is of run [0-9a-f]{{32}}, the checkpoint of run [0-9a-f]{{32}}: "
                        r"it comes from another run"),
        ("another shape", r"file {f} holds \S+ as \[\d+(, \d+)*\] F64, model\.shards\.json says "
                          r"\[\d+(, \d+)*\] float64: a file of another model"),
    ],
)  # fmt: skip
def test_a_swapped_shard_is_refused_on_resume_naming_the_file(
    runs, other_runs, tmp_path, source, message
):
    """Rank 1's model shard of step 2 replaced by rank 1's shard of another 2-rank run, the
    manifest and COMMITTED recomputed: `rlhflab train --resume` refuses in one line naming the
    file (exit 2), before anything is loaded or written."""
    cfg, run = runs
    root = tmp_path / "runs"
    copy = Path(shutil.copytree(run[2], root / run[2].name))
    ck = copy / STEP2
    fname = "model-rank00001-of-00002.safetensors"
    shutil.copy(other_runs[source] / STEP2 / fname, ck / fname)
    reseal(ck)
    before = (copy / "metrics.jsonl").read_bytes()
    args = ["train", str(cfg), f"run.root={root}", "parallel.strategy=fsdp2", "--resume", str(ck)]
    res = _rlhflab(1, args)  # the run's own config: only the swapped file is wrong
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr[-3000:]
    assert len(lines) == 1, lines
    assert re.fullmatch(rf"error: checkpoint {re.escape(str(ck))}: " + message.format(f=fname),
                        lines[0]), lines[0]  # fmt: skip
    assert (copy / "metrics.jsonl").read_bytes() == before


def test_two_ranks_resume_in_one_process(runs, tmp_path):
    cfg, run = runs
    _assert_next_step_equal(run[2], _resume(run[2], 1, cfg, tmp_path))


def test_one_process_resumes_in_two_ranks(runs, tmp_path):
    """The 1-process checkpoint is the ordinary full file; each FSDP2 rank reads its slices."""
    cfg, run = runs
    assert (run[1] / STEP2 / "model.safetensors").is_file()
    resumed = _resume(run[1], 2, cfg, tmp_path)
    _assert_next_step_equal(run[1], resumed)
    assert {p.name for p in (resumed / f"checkpoints/step-{STEPS:08d}").iterdir()} >= SHARDED_FILES


def test_sigterm_on_one_rank_checkpoints_shards_then_resumes_in_one_process(runs, tmp_path):
    """SIGTERM reaches rank 1 mid-step 2 (checkpoints off otherwise): both ranks finish the step,
    write their shards of one committed checkpoint and stop; one process resumes from it."""
    cfg, run = runs
    raw = yaml.safe_load(cfg.read_text())
    raw["checkpoint"] = {"every": 0}
    cfg0 = _write_cfg(tmp_path / "every0.yaml", raw)
    root = tmp_path / "stopped"
    args = ["train", str(cfg0), f"run.root={root}", "parallel.strategy=fsdp2"]
    res = _rlhflab(2, args, RLHFLAB_FAULT="rank1:step_mid@2=sigterm")
    assert res.returncode != 0
    stopped = _run_dir(root)
    assert [p.name for p in committed_checkpoints(stopped)] == ["step-00000002"]
    assert {p.name for p in (stopped / STEP2).iterdir()} >= SHARDED_FILES
    resumed = _run(1, cfg0, root, "--resume", str(stopped))
    _assert_next_step_equal(run[2], resumed)


def test_a_failed_shard_write_on_one_rank_stops_every_rank(runs, tmp_path):
    """Rank 1's first shard file hits a full disk: every rank stops (no hang), the error names
    the rank and the file, nothing is committed and no temporary directory is left."""
    cfg, _ = runs
    root = tmp_path / "full"
    args = ["train", str(cfg), f"run.root={root}", "parallel.strategy=fsdp2"]
    res = _rlhflab(2, args, RLHFLAB_FAULT="rank1:checkpoint_file@1=enospc")
    assert res.returncode != 0
    assert "rank 1 failed writing its shards: DiskFullError: disk full" in res.stderr
    assert "model-rank00001-of-00002.safetensors" in res.stderr
    run = _run_dir(root)
    assert committed_checkpoints(run) == []
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_grpo_two_ranks_resume_in_one_process(base_model, tmp_path):  # noqa: F811
    """GRPO with a KL reference (sampling and shuffling generators): the sharded policy and its
    AdamW state at step 2 of a 2-rank FSDP2 run, resumed by one process with rank 0's random
    streams, give the uninterrupted run's steps 3 and 4."""
    raw = _grpo(base_model)
    raw["train"]["steps"] = STEPS
    raw["eval"] = {"n": 0}
    cfg = _write_cfg(tmp_path / "grpo.yaml", raw)
    ref = _run(2, cfg, tmp_path / "runs")
    assert (ref / STEP2 / "model.shards.json").is_file()
    _assert_next_step_equal(ref, _resume(ref, 1, cfg, tmp_path))

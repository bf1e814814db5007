"""Checkpoint provenance in one process: every tensor file carries its run's id and step, so a
file swapped in from another run or another step, a checkpoint copied from another run, or a
manifest whose step disagrees, is refused in one line naming the file, even behind a manifest
recomputed the way the checkpointer computes it. A checkpoint of format 1 (before run ids) still
resumes, with a one-line warning. The sharded (FSDP2) files are in
tests/distributed/test_sharded_checkpoint.py and tests/test_checkpoint_sharded.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from factories import reseal
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_checkpoint_resume import run_cli, sft_raw

from rlhflab.checkpoint import (
    COMMITTED,
    MANIFEST,
    committed_checkpoints,
    find_resume_checkpoint,
    load_checkpoint,
    provenance_note,
    sha256_file,
)
from rlhflab.config import config_from_dict
from rlhflab.errors import CheckpointError
from rlhflab.rundir import RUN_ID
from rlhflab.trainers import run_config

pytestmark = pytest.mark.slow


def _raw(root, name):
    raw = sft_raw(root, name=name, steps=2)
    raw["eval"] = {"n": 0}
    raw["checkpoint"] = {"every": 1, "keep_last": None}
    return raw


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two runs of the same config and shapes (2 steps, a checkpoint after each)."""
    root = tmp_path_factory.mktemp("prov")
    return [Path(run_config(config_from_dict(_raw(root / f"r{i}", "sft")))["run_dir"])
            for i in (0, 1)]  # fmt: skip


def _copy(run: Path, tmp: Path) -> Path:
    return Path(shutil.copytree(run, tmp / "runs" / run.name))


def _one_line_naming(exc, *parts):
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for part in parts:
        assert part in msg, (part, msg)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "rng.safetensors"])
def test_a_file_of_another_run_is_refused_naming_it(two_runs, tmp_path, name):
    a, b = two_runs
    run = _copy(a, tmp_path)
    ck = committed_checkpoints(run)[-1]
    shutil.copy(committed_checkpoints(b)[-1] / name, ck / name)  # same shapes, other run
    reseal(ck)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(ck)
    other = (b / RUN_ID).read_text().strip()
    _one_line_naming(exc, f"file {name} is of run {other}", "another run", str(ck))


def test_a_file_of_another_step_is_refused_naming_it(two_runs, tmp_path):
    run = _copy(two_runs[0], tmp_path)
    step1, step2 = committed_checkpoints(run)
    shutil.copy(step1 / "model.safetensors", step2 / "model.safetensors")
    reseal(step2)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(step2)
    _one_line_naming(exc, "file model.safetensors is of step 1", "of step 2")


def test_a_manifest_of_another_step_is_refused(two_runs, tmp_path):
    run = _copy(two_runs[0], tmp_path)
    ck = committed_checkpoints(run)[-1]
    manifest = json.loads((ck / MANIFEST).read_text())
    manifest["step"] = 1
    (ck / MANIFEST).write_text(json.dumps(manifest))
    (ck / COMMITTED).write_text(sha256_file(ck / MANIFEST) + "\n")
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(ck)
    _one_line_naming(exc, f"{MANIFEST} says step 1, state.json step 2")


def test_a_checkpoint_of_another_run_is_not_resumed(two_runs, tmp_path):
    """A whole step directory of run b, copied into run a (every file consistent with itself):
    `rlhflab train --resume` refuses it in one line, exit 2, naming the checkpoint."""
    a, b = two_runs
    run = _copy(a, tmp_path)
    ck = committed_checkpoints(run)[-1]
    shutil.rmtree(ck)
    shutil.copytree(committed_checkpoints(b)[-1], ck)
    with pytest.raises(CheckpointError, match="a checkpoint copied from another run"):
        find_resume_checkpoint(str(ck), str(run.parent), "sft")
    raw = _raw(run.parent, "sft")
    raw["train"]["steps"] = 3
    res = run_cli(tmp_path, raw, "--resume", str(ck), check=False)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: checkpoint {ck}: of run "), lines


def test_a_run_directory_without_its_run_id_says_how_to_proceed(two_runs, tmp_path):
    run = _copy(two_runs[0], tmp_path)
    (run / RUN_ID).unlink()
    with pytest.raises(CheckpointError) as exc:
        find_resume_checkpoint(str(run), str(run.parent), "sft")
    ck = committed_checkpoints(run)[-1]
    _one_line_naming(exc, f"has no {RUN_ID} file", f"into {run / RUN_ID} to resume it")
    assert load_checkpoint(ck).run_id in str(exc.value)


def _as_format_1(ck: Path) -> None:
    """What a checkpoint written before run ids holds: no run id or step in any file's header
    nor in the manifest, format_version 1."""
    for f in ck.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            meta = {k: v for k, v in (h.metadata() or {}).items() if not k.startswith("rlhflab.")}
        save_file(load_file(str(f)), str(f), metadata=meta or None)
    manifest = json.loads((ck / MANIFEST).read_text())
    manifest.pop("run_id")
    manifest["format_version"] = 1
    (ck / MANIFEST).write_text(json.dumps(manifest))
    reseal(ck)


def test_a_format_1_checkpoint_resumes_with_a_warning(two_runs, tmp_path):
    a, b = two_runs
    run = _copy(a, tmp_path)
    (run / "final_results.json").unlink()  # its end is redone
    (run / RUN_ID).unlink()  # a run directory of that version had none
    ck = committed_checkpoints(run)[-1]
    _as_format_1(ck)
    # A newer file swapped into the old checkpoint (a copy of it) is refused: it names its run.
    swapped = Path(shutil.copytree(ck, tmp_path / "swapped" / "checkpoints" / ck.name))
    shutil.copy(committed_checkpoints(b)[-1] / "rng.safetensors", swapped / "rng.safetensors")
    reseal(swapped)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(swapped)
    _one_line_naming(exc, "file rng.safetensors is of run", "without run id (format 1)")
    # The old checkpoint itself resumes, with the warning; the resumed run gets an id.
    loaded = find_resume_checkpoint(str(run), str(run.parent), "sft")
    assert loaded.run_id is None
    assert provenance_note(loaded) == (
        "warning: checkpoint step-00000002 predates run ids (checkpoint format 1): resumed "
        "without checking that its files belong to this run"
    )
    raw = _raw(run.parent, "sft")
    raw["run"]["resume"] = str(run)
    with pytest.warns(UserWarning, match="predates run ids"):
        res = run_config(config_from_dict(raw))
    assert res["status"] == "complete"
    assert load_checkpoint(ck).run_id == (run / RUN_ID).read_text().strip()  # rewritten at step 2

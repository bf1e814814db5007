"""Fault injection: crashed writers, corrupted checkpoints, changed configs, retention, NaN policy,
stop signals, secrets and paths. Runs are tiny SFT / GRPO runs (seconds each)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint_resume import (
    assert_same_run,
    grpo_raw,
    metrics,
    run_cli,
    run_dir_of,
    sft_raw,
)

from rlhflab.checkpoint import (
    COMMITTED,
    Checkpointer,
    committed_checkpoints,
    find_resume_checkpoint,
    load_checkpoint,
)
from rlhflab.config import config_from_dict
from rlhflab.errors import CheckpointError, ConfigError, Interrupted, NonFiniteError
from rlhflab.trainers import run_config


def sft(root, *, resume=None, checkpoint=None, **train):
    raw = sft_raw(root, **train)
    if checkpoint:
        raw["checkpoint"] = checkpoint
    if resume is not None:
        raw["run"]["resume"] = str(resume)
    return raw


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 6-step SFT run with a committed checkpoint after every step (none deleted)."""
    root = tmp_path_factory.mktemp("finished")
    res = run_config(
        config_from_dict(sft(root, steps=6, checkpoint={"every": 1, "keep_last": None}))
    )
    return Path(res["run_dir"])


def test_checkpoint_layout_and_manifest(finished):
    ckpts = committed_checkpoints(finished)
    assert [p.name for p in ckpts] == [f"step-{i:08d}" for i in range(1, 7)]
    ck = load_checkpoint(ckpts[-1])
    names = {p.name for p in ckpts[-1].iterdir()}
    assert names == {
        "model.safetensors",
        "optimizer.safetensors",
        "rng.safetensors",
        "state.json",
        "manifest.json",
        COMMITTED,
        # a transformers model directory too (tests/test_checkpoint_hf.py)
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    }
    assert not any(n.endswith((".pt", ".bin", ".pkl")) for n in names)  # no pickle
    assert ck.step == 6 and set(ck.manifest["versions"]) >= {"torch", "rlhflab", "transformers"}
    assert len(ck.manifest["config_hash"]) == 64
    # The checkpoint's weights are the final model's weights.
    final = load_file(str(finished / "model/model.safetensors"))
    ckw = load_file(str(ckpts[-1] / "model.safetensors"))
    # The embedding is tied to lm_head: HF's save keeps one name of the pair, safetensors' the other.
    tied = {"model.embed_tokens.weight": "lm_head.weight"}
    for k, v in final.items():
        assert torch.equal(v, ckw[k] if k in ckw else ckw[tied[k]]), k


def _copy_run(src: Path, dst_root: Path) -> Path:
    import shutil

    dst = dst_root / src.name
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "damage, fname",
    [
        ("flip", "model.safetensors"),
        ("flip", "state.json"),
        ("flip", "manifest.json"),
        ("truncate", "optimizer.safetensors"),
        ("delete", "rng.safetensors"),
        ("delete", COMMITTED),
        ("extra", "stray.bin"),
    ],
)
def test_corrupted_checkpoint_is_refused_naming_the_file(tmp_path, finished, damage, fname):
    run = _copy_run(finished, tmp_path)
    ck = committed_checkpoints(run)[-1]
    f = ck / fname
    if damage == "flip":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:-7])
    elif damage == "delete":
        f.unlink()
    else:
        f.write_bytes(b"x")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(ck)
    assert ck.name in str(err.value)
    assert fname in str(err.value) or (fname == COMMITTED and "COMMITTED" in str(err.value))
    # Asked to resume from it: refused, nothing new started (no new run directory).
    before = sorted(tmp_path.iterdir())
    with pytest.raises((CheckpointError, ConfigError)):
        run_config(config_from_dict(sft(tmp_path, steps=6, resume=ck)))
    assert sorted(tmp_path.iterdir()) == before


def test_resume_requests_never_start_fresh(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        find_resume_checkpoint(str(tmp_path / "nope"), str(tmp_path), "sft")
    (tmp_path / "sft-1").mkdir()
    with pytest.raises(ConfigError, match="no committed checkpoint"):
        find_resume_checkpoint(str(tmp_path / "sft-1"), str(tmp_path), "sft")
    with pytest.raises(ConfigError, match="no committed checkpoint"):
        find_resume_checkpoint("latest", str(tmp_path), "sft")
    assert find_resume_checkpoint("auto", str(tmp_path), "sft") is None  # auto: fresh is fine


def test_resume_path_outside_runs_root_is_refused(tmp_path, finished):
    root = tmp_path / "runs"
    root.mkdir()
    with pytest.raises(ConfigError, match="outside the runs root"):
        find_resume_checkpoint(str(finished), str(root), "sft")
    (root / "link").symlink_to(finished)  # a symlink inside the root that points out of it
    with pytest.raises(ConfigError, match="outside the runs root"):
        find_resume_checkpoint(str(root / "link"), str(root), "sft")
    with pytest.raises(ConfigError, match=r"run\.name"):
        config_from_dict(sft(root) | {"run": {"name": "../escape", "root": str(root)}})


def test_writer_crash_leaves_previous_checkpoint_intact(tmp_path, finished):
    """A checkpoint write that dies after i files never yields a committed checkpoint."""
    run = _copy_run(finished, tmp_path)
    ck = load_checkpoint(committed_checkpoints(run)[-1])
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    for crash_after in range(6):  # the write of file crash_after+1 fails
        writer = Checkpointer(
            run, ck.state["config"], modules={"model": model}, optimizers={"opt": opt},
            schedulers={}, keep_last=1,
        )  # fmt: skip
        original = writer._write

        def failing(tmp, name, write, original=original, writer=writer, n=crash_after):
            if writer.files_written == n:
                raise OSError("disk full (injected)")
            original(tmp, name, write)

        writer._write = failing
        with pytest.raises(OSError):
            writer.save(7, {})
        assert [p.name for p in committed_checkpoints(run)][-1] == "step-00000006"
        assert not (run / "checkpoints" / "step-00000007").exists()
        assert not list((run / "checkpoints").glob(".tmp-*"))


def test_sigkill_during_checkpoint_write_resumes_from_previous(tmp_path):
    """SIGKILL after the 2nd file of the 2nd checkpoint (step 10): the temp directory is left
    behind, ignored, and the run resumes exactly from step 5."""
    ref = run_config(config_from_dict(sft(tmp_path / "ref")))["run_dir"]
    (tmp_path / "runs").mkdir()
    raw = sft(tmp_path / "runs")
    # A checkpoint of this SFT run is 11 files (model, config, generation config, 3 tokenizer
    # files, optimizer, rng, state, manifest, COMMITTED): the 13th is the 2nd of step 10's.
    assert run_cli(tmp_path, raw, fault="checkpoint_file@13=sigkill", check=False).returncode == -9
    run = run_dir_of(tmp_path / "runs", "sft")
    assert [p.name for p in committed_checkpoints(run)] == ["step-00000005"]
    assert list((run / "checkpoints").glob(".tmp-step-00000010-*"))
    run_cli(tmp_path, raw, "--resume")
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert_same_run(ref, run)


def test_config_change_on_resume_lists_keys(tmp_path, finished):
    run = _copy_run(finished, tmp_path)
    raw = sft(tmp_path, steps=6, resume=run, checkpoint={"every": 1, "keep_last": None})
    raw["train"]["batch_size"] = 4
    raw["seed"] = 3
    with pytest.raises(ConfigError) as err:
        run_config(config_from_dict(raw))
    assert "seed" in str(err.value) and "train.batch_size" in str(err.value)
    # Harmless keys (eval, tracking, checkpointing) may change; the flag allows the rest.
    raw = sft(tmp_path, steps=8, resume=run, checkpoint={"every": 2, "keep_last": 1})
    raw["eval"]["n"] = 2
    with pytest.raises(ConfigError, match=r"train\.steps"):
        run_config(config_from_dict(raw))
    raw["run"]["allow_config_change"] = True
    res = run_config(config_from_dict(raw))
    assert res["steps"] == 8
    steps = [r["step"] for r in metrics(run) if "train/loss" in r]
    assert steps == list(range(1, 9))  # continued, no duplicate rows


def test_keep_last_keeps_newest_and_resumed_from(tmp_path, finished):
    run = _copy_run(finished, tmp_path)
    resumed_from = committed_checkpoints(run)[2]  # step 3
    raw = sft(tmp_path, steps=6, resume=resumed_from, checkpoint={"every": 1, "keep_last": 1})
    run_config(config_from_dict(raw))
    assert [p.name for p in committed_checkpoints(run)] == ["step-00000003", "step-00000006"]
    assert not [p for p in (run / "checkpoints").iterdir() if p.name not in
                ("step-00000003", "step-00000006")]  # fmt: skip


def test_resume_of_a_finished_run_redoes_no_step(tmp_path, finished):
    run = _copy_run(finished, tmp_path)
    before = metrics(run)
    res = run_config(
        config_from_dict(
            sft(tmp_path, steps=6, resume=run, checkpoint={"every": 1, "keep_last": None})
        )
    )
    assert res["steps"] == 6
    after = [r for r in metrics(run) if "train/loss" in r]
    assert after == [r for r in before if "train/loss" in r]


# -- NaN policy -------------------------------------------------------------------------------


def test_nan_raise_stops_before_the_optimizer_step(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFLAB_FAULT", "loss@3=nan")
    raw = sft(tmp_path, steps=6, checkpoint={"every": 1, "keep_last": None})
    with pytest.raises(NonFiniteError, match=r"step 3: train/loss is nan"):
        run_config(config_from_dict(raw))
    run = run_dir_of(tmp_path, "sft")
    assert [p.name for p in committed_checkpoints(run)][-1] == "step-00000002"


def test_nan_skip_skips_exactly_that_step(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFLAB_FAULT", "loss@3=inf")
    raw = sft(tmp_path, steps=5, checkpoint={"every": 1, "keep_last": None}, nan_policy="skip")
    res = run_config(config_from_dict(raw))
    assert res["steps"] == 5
    run = Path(res["run_dir"])
    rows = {r["step"]: r for r in metrics(run) if "train/loss" in r}
    assert [rows[s]["train/nan_skips"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    ck = committed_checkpoints(run)
    w2, w3 = (load_file(str(ck[i] / "model.safetensors")) for i in (1, 2))
    assert all(torch.equal(w2[k], w3[k]) for k in w2)  # no update at step 3
    o2, o3 = (load_file(str(ck[i] / "optimizer.safetensors")) for i in (1, 2))
    assert all(torch.equal(o2[k], o3[k]) for k in o2)  # no optimizer state change (incl. step)
    s2, s3 = (json.loads((ck[i] / "state.json").read_text()) for i in (1, 2))
    assert s2["schedulers"]["scheduler"] == s3["schedulers"]["scheduler"]  # no scheduler step


def test_nan_skip_aborts_after_k_in_a_row(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHFLAB_FAULT", "loss@2=nan,loss@3=nan,loss@4=nan")
    raw = sft(tmp_path, steps=6, nan_policy="skip", nan_max_skips=3)
    with pytest.raises(NonFiniteError, match=r"step 4: .*3 non-finite steps in a row"):
        run_config(config_from_dict(raw))


def test_nan_raise_in_policy_gradient_names_the_metric(tmp_path, monkeypatch, finished):
    monkeypatch.setenv("RLHFLAB_FAULT", "loss@2=nan")
    with pytest.raises(NonFiniteError, match=r"step 2: policy/loss is nan"):
        run_config(config_from_dict(grpo_raw(tmp_path, finished / "model")))


# -- Stop signals -----------------------------------------------------------------------------


def test_sigterm_finishes_the_step_checkpoints_and_resumes_exactly(tmp_path, monkeypatch):
    ref = run_config(config_from_dict(sft(tmp_path / "ref")))["run_dir"]
    (tmp_path / "runs").mkdir()
    monkeypatch.setenv("RLHFLAB_FAULT", "step_mid@7=sigterm")
    with pytest.raises(Interrupted) as err:
        run_config(config_from_dict(sft(tmp_path / "runs")))
    assert err.value.step == 7 and err.value.exit_code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    run = run_dir_of(tmp_path / "runs", "sft")
    assert committed_checkpoints(run)[-1].name == "step-00000007"
    monkeypatch.delenv("RLHFLAB_FAULT")
    run_config(config_from_dict(sft(tmp_path / "runs", resume="latest")))
    assert_same_run(ref, run)


def test_cli_exit_code_on_sigint(tmp_path):
    proc = run_cli(tmp_path, sft(tmp_path), fault="step_mid@4=sigint", check=False)
    assert proc.returncode == 130, proc.stderr[-500:]
    assert "interrupted: stopped by SIGINT after step 4" in proc.stderr
    assert committed_checkpoints(run_dir_of(tmp_path, "sft"))[-1].name == "step-00000004"


def test_external_sigterm_to_a_running_process(tmp_path):
    """A real signal from outside, at whatever step the run has reached."""
    import yaml

    raw = sft(tmp_path, steps=100000)
    cfg = tmp_path / "long.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhflab.cli", "train", str(cfg)],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        runs = list(tmp_path.glob("sft-*"))
        if runs and (runs[0] / "metrics.jsonl").exists() and metrics(runs[0]):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-500:]
    ck = load_checkpoint(committed_checkpoints(runs[0])[-1])
    assert 0 < ck.step < 100000
    assert [r["step"] for r in metrics(runs[0]) if "train/loss" in r][-1] == ck.step


# -- Secrets ----------------------------------------------------------------------------------


def test_secrets_never_reach_the_run_directory(tmp_path):
    canaries = {
        "WANDB_API_KEY": "canary-wandb-8f3a91c2d4",
        "HF_TOKEN": "hf_canaryTOKEN5521aa",
        "OPENAI_API_KEY": "sk-canary-77e1b0",
    }
    raw = sft(tmp_path, steps=4, checkpoint={"every": 2, "keep_last": None})
    # A secret that found its way into a config value must be redacted wherever it is written.
    raw["data"] = {"source": "task", "path": f"/data/{canaries['HF_TOKEN']}.jsonl"}
    env_backup = dict(os.environ)
    os.environ.update(canaries)
    try:
        run_config(config_from_dict(raw))
        # An error message that quotes a secret is redacted on the console too.
        bad = sft(tmp_path, steps=2)
        bad["data"] = {"source": "jsonl", "path": str(tmp_path / f"{canaries['HF_TOKEN']}.jsonl")}
        proc = run_cli(tmp_path, bad, check=False)
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    run_dirs = [d for d in tmp_path.iterdir() if d.is_dir()]  # (the test's own YAML is beside)
    files = [p for d in run_dirs for p in d.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in files) and any(
        p.suffix == ".safetensors" for p in files
    )
    for p in files:
        data = p.read_bytes()
        for value in canaries.values():
            assert value.encode() not in data, (p, value)
    assert proc.returncode == 2 and "error: data.path" in proc.stderr
    for value in canaries.values():
        assert value not in proc.stderr


def test_stop_signal_during_the_ranks_agreement_is_not_lost(tmp_path, monkeypatch):
    """A SIGTERM whose handler runs while `end_step` waits in its collective (the usual case for a
    small model under torchrun: most of a step is spent in collectives) must stop the run at the
    next step. Before, the stale answer of the collective overwrote the flag the handler had just
    set, the signal was lost, and the workers trained on after torchrun forwarded SIGTERM."""
    from rlhflab import distributed
    from rlhflab.checkpoint import Checkpointer, StopSignals

    model = torch.nn.Linear(2, 2)
    ck = Checkpointer(tmp_path, {}, modules={"model": model}, optimizers={}, schedulers={})
    stop = StopSignals()
    calls = []

    def any_rank_with_signal_arriving(flag):
        calls.append(flag)
        if len(calls) == 1:  # step 1: the signal arrives during the first agreement
            stop._handler(signal.SIGTERM, None)
        return int(flag or 0)  # what the ranks agreed on: the flag as it was read

    monkeypatch.setattr(distributed, "any_rank", any_rank_with_signal_arriving)
    ck.end_step(1, stop, dict)  # agreed "no signal": this step goes on
    with pytest.raises(Interrupted) as stopped:
        ck.end_step(2, stop, dict)  # the next agreement sees the signal: every rank stops here
    assert stopped.value.signum == signal.SIGTERM and stopped.value.step == 2

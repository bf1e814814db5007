"""wandb and trackio sinks: options from the config and WANDB_* variables, the run id saved in
checkpoints so a resumed run continues the same tracker run, samples logged as tables. The glue is
tested with fake modules in sys.modules (CI installs neither package); the real packages, when
installed, in offline / local mode."""

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
from test_checkpoint_resume import sft_raw

from rlhflab.config import config_from_dict
from rlhflab.runs import SampleWriter
from rlhflab.tracking import (
    WANDB_SETTINGS,
    Tracker,
    check_wandb_settings,
    trackio_init_kwargs,
    wandb_init_kwargs,
)
from rlhflab.trainers import run_config

# CI sets RLHFLAB_REQUIRE_WANDB=1 in its wandb step, so a wandb that fails to install or import
# fails the real-wandb tests there instead of skipping them.
NO_WANDB = importlib.util.find_spec("wandb") is None and not os.environ.get("RLHFLAB_REQUIRE_WANDB")


def test_wandb_defaults_without_config_or_environment(tmp_path):
    kw = wandb_init_kwargs(True, tmp_path / "sft-1", {"a": 1}, env={})
    assert kw == {"config": {"a": 1}, "dir": str(tmp_path / "sft-1"), "project": "rlhflab",
                  "name": "sft-1", "settings": WANDB_SETTINGS}  # fmt: skip
    # what wandb would record unredacted is off: metadata (the command line), code, git, console
    assert WANDB_SETTINGS["x_disable_meta"] is True and WANDB_SETTINGS["console"] == "off"


def test_wandb_environment_is_left_to_wandb(tmp_path):
    env = {"WANDB_PROJECT": "p-env", "WANDB_NAME": "n-env", "WANDB_ENTITY": "e-env"}
    kw = wandb_init_kwargs({}, tmp_path / "r", None, env=env)
    assert not {"project", "name", "entity", "group", "tags"} & set(kw)  # wandb reads them


def test_wandb_config_options_win(tmp_path):
    opts = {"project": "p", "entity": "e", "group": "g", "tags": ["a", "b"], "name": "n"}
    kw = wandb_init_kwargs(opts, tmp_path / "r", None, env={"WANDB_PROJECT": "p-env"})
    assert {k: kw[k] for k in opts} == opts


def test_wandb_resume_continues_the_saved_run_unless_the_user_names_one(tmp_path):
    kw = wandb_init_kwargs(True, tmp_path, None, resume_id="abc123", env={})
    assert (kw["id"], kw["resume"]) == ("abc123", "allow")
    kw = wandb_init_kwargs(True, tmp_path, None, resume_id="abc123", env={"WANDB_RUN_ID": "mine"})
    assert "id" not in kw and "resume" not in kw


def test_trackio_kwargs(tmp_path):
    kw = trackio_init_kwargs(True, tmp_path / "dpo-2", {"x": 1})
    assert kw == {"project": "rlhflab", "name": "dpo-2", "config": {"x": 1}}
    kw = trackio_init_kwargs({"project": "p", "group": "g"}, tmp_path / "r", None,
                             resume={"project": "p", "name": "old"})  # fmt: skip
    assert kw == {"project": "p", "name": "old", "config": None, "group": "g", "resume": "allow"}


class _Table:
    def __init__(self, columns, data):
        self.columns, self.data = columns, data


def _fake_wandb(calls: list):
    """A module with wandb's init / log / finish / Table that records what it is given."""
    mod = types.ModuleType("wandb")
    # a spec, as a real module has: `importlib.util.find_spec` (accelerate asks it on import
    # whether wandb is installed) raises on a module in sys.modules without one
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    class Run:
        def __init__(self, **kw):
            self.id = kw.get("id", f"run{len(calls)}")
            calls.append(("init", kw))

        def log(self, data, step=None):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    mod.init = lambda **kw: Run(**kw)
    mod.Table = _Table
    return mod


def _fake_trackio(calls: list):
    mod = types.ModuleType("trackio")
    mod.__spec__ = importlib.machinery.ModuleSpec("trackio", None)
    mod.init = lambda **kw: calls.append(("init", kw))
    mod.log = lambda data, step=None: calls.append(("log", step, data))
    mod.finish = lambda: calls.append(("finish",))
    mod.Table = _Table
    return mod


def _sft(root, **tracking):
    raw = sft_raw(root, steps=4)
    raw["checkpoint"] = {"every": 2, "keep_last": 3}
    raw["tracking"] = {"console": False, **tracking}
    return raw


def test_resumed_sft_run_continues_the_same_wandb_and_trackio_runs(tmp_path, monkeypatch):
    calls_w, calls_t = [], []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls_w))
    monkeypatch.setitem(sys.modules, "trackio", _fake_trackio(calls_t))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    wandb = {"project": "study", "tags": ["sft", "tiny"], "group": "g1"}
    res = run_config(config_from_dict(_sft(tmp_path, wandb=wandb, trackio=True)))
    run_dir = Path(res["run_dir"])
    init = calls_w[0][1]
    assert (init["project"], init["tags"], init["group"]) == ("study", ["sft", "tiny"], "g1")
    assert init["name"] == run_dir.name and "id" not in init
    # step 0: the held-out evaluation before training (SFT evaluates at step 0, issue 23)
    assert sorted({c[1] for c in calls_w if c[0] == "log"}) == [0, 1, 2, 3, 4]
    assert calls_w[-1] == ("finish",)
    assert calls_t[0][1]["name"] == run_dir.name and "resume" not in calls_t[0][1]
    assert sorted({c[1] for c in calls_t if c[0] == "log"}) == [0, 1, 2, 3, 4]
    ckpt = run_dir / "checkpoints" / "step-00000002"
    saved = json.loads((ckpt / "state.json").read_text())["stateful"]["tracker"]
    assert saved == {"wandb_id": "run0", "trackio": {"project": "rlhflab", "name": run_dir.name}}

    calls_w.clear(), calls_t.clear()
    raw = _sft(tmp_path, wandb=wandb, trackio=True)
    raw["run"]["resume"] = str(ckpt)
    run_config(config_from_dict(raw))
    init = calls_w[0][1]
    assert (init["id"], init["resume"]) == ("run0", "allow")
    assert sorted({c[1] for c in calls_w if c[0] == "log"}) == [3, 4]
    assert calls_t[0][1]["resume"] == "allow" and calls_t[0][1]["name"] == run_dir.name


def test_samples_are_logged_as_tables(tmp_path, monkeypatch):
    calls_w, calls_t = [], []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls_w))
    monkeypatch.setitem(sys.modules, "trackio", _fake_trackio(calls_t))
    tracker = Tracker(tmp_path, total_steps=3, console_enabled=False, wandb=True, trackio=True)
    writer = SampleWriter(tmp_path, tracker=tracker)
    rows = [{"prompt": "1+1=", "completion": "2", "reward": 1.0},
            {"prompt": "2+2=", "completion": "5", "reward": 0.0, "answer": "4"}]  # fmt: skip
    writer.write(10, rows)
    writer.close()
    tracker.close()
    for calls in (calls_w, calls_t):
        (_, step, data), = [c for c in calls if c[0] == "log"]  # fmt: skip
        table = data["samples"]
        assert step == 10
        assert table.columns == ["prompt", "completion", "reward", "answer"]
        assert table.data == [["1+1=", "2", 1.0, None], ["2+2=", "5", 0.0, "4"]]
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 2


def test_missing_trackio_is_named_before_the_run_directory(tmp_path, monkeypatch):
    from rlhflab.errors import ConfigError

    monkeypatch.setitem(sys.modules, "trackio", None)
    with pytest.raises(ConfigError, match=r"tracking\.trackio: .*pip install 'rlhflab\[trackio\]'"):
        run_config(config_from_dict(_sft(tmp_path / "runs", trackio=True)))
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_bad_wandb_option_is_a_config_error():
    from rlhflab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tracking\.wandb\.projct.*did you mean 'project'"):
        config_from_dict(_sft("runs", wandb={"projct": "x"}))


@pytest.mark.skipif(NO_WANDB, reason="wandb not installed")
def test_real_wandb_offline_resumes_the_same_run(tmp_path):
    script = textwrap.dedent(
        """
        import json, sys
        import wandb
        from rlhflab.runs import SampleWriter
        from rlhflab.tracking import Tracker
        run_dir = sys.argv[1]
        t = Tracker(run_dir, total_steps=2, console_enabled=False,
                    wandb={"project": "p", "tags": ["x"]})
        t.log(1, {"loss": 0.5})
        SampleWriter(run_dir, tracker=t).write(1, [{"prompt": "a", "completion": "b"}])
        first = t.state()
        t.close()
        t = Tracker(run_dir, total_steps=2, console_enabled=False, wandb=True, resume_state=first)
        t.log(2, {"loss": 0.25})
        second = wandb.run.id
        t.close()
        print(json.dumps({"first": first, "second": second}))
        """
    )
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
           "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["second"] == got["first"]["wandb_id"]


def test_a_wandb_without_the_privacy_switches_is_refused():
    from rlhflab.errors import ConfigError

    fields = {k: None for k in WANDB_SETTINGS if k != "x_disable_meta"}
    settings = types.SimpleNamespace(model_fields=fields)
    old = types.SimpleNamespace(Settings=settings, __version__="0.15.0")
    with pytest.raises(ConfigError, match=r"tracking\.wandb: wandb 0\.15\.0 has no setting "
                       r"x_disable_meta"):  # fmt: skip
        check_wandb_settings(old)


WANDB_SECRET = "K svc-2b7c91e4f0"


@pytest.mark.slow
@pytest.mark.skipif(NO_WANDB, reason="wandb not installed")
def test_real_wandb_offline_run_directory_holds_no_secret(tmp_path):
    """`rlhflab train ... tracking.wandb=true task.system=<secret>` with wandb offline: no file
    under the run directory, wandb's own included (`wandb/offline-run-*/run-*.wandb` and its
    logs), holds the secret. wandb records the process's command line in its run metadata; before
    `WANDB_SETTINGS` the .wandb file held `task.system=K svc-...` whole."""
    import yaml

    raw = sft_raw(tmp_path / "runs", steps=2)
    raw["tracking"] = {"console": False, "wandb": True}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(raw))
    env = {**os.environ, "SERVICE_TOKEN": WANDB_SECRET, "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wb-config"),
           "WANDB_CACHE_DIR": str(tmp_path / "wb-cache"), "WANDB_DATA_DIR": str(tmp_path / "wb-data"),
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    for k in ("WANDB_DIR", "WANDB_DISABLE_GIT", "WANDB_CONSOLE", "RLHFLAB_FAULT"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "-m", "rlhflab.cli", "train", str(tmp_path / "sft.yaml"),
         f"task.system={WANDB_SECRET}"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = next((tmp_path / "runs").glob("sft-*"))
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files), "wandb wrote no run file"
    needle = WANDB_SECRET.split()[-1].encode()
    assert [p for p in files if needle in p.read_bytes()] == []
    assert WANDB_SECRET.split()[-1] not in proc.stdout + proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("trackio") is None, reason="trackio not installed")
def test_real_trackio_local_logs_and_resumes(tmp_path):
    script = textwrap.dedent(
        """
        import json, sys
        from rlhflab.tracking import Tracker
        run_dir = sys.argv[1] + "/sft-7"
        import os; os.makedirs(run_dir)
        t = Tracker(run_dir, total_steps=2, console_enabled=False, trackio={"project": "p"})
        t.log(1, {"loss": 0.5})
        first = t.state()
        t.close()
        t = Tracker(run_dir, total_steps=2, console_enabled=False, trackio=True,
                    resume_state=first)
        t.log(2, {"loss": 0.25})
        t.close()
        import trackio
        print(json.dumps({"first": first, "runs": trackio.Api().runs("p") and
                          [r.name for r in trackio.Api().runs("p")]}))
        """
    )
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["first"] == {"trackio": {"project": "p", "name": "sft-7"}}
    assert got["runs"] == ["sft-7"]  # one run, continued

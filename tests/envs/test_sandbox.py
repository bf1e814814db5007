"""The python tool's sandbox against code written to escape it (issue #37), called as the trainer
calls it (`python_sandbox`, through `Environment.run_tool` where it matters), with a secret in the
caller's environment, and as root where the tests run as root.

The isolated sandbox needs bubblewrap with unprivileged user namespaces: these tests skip (with
the reason) where it does not work, and fail instead under RLHFLAB_REQUIRE_BWRAP=1 (CI). The
`unsafe_local` mode (no OS isolation; bwrap hidden from PATH) runs the tests its own layers
(audit hook, rlimits, bounded reads) are meant to pass (fixtures: tests/envs/conftest.py)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from rlhflab.envs import tools
from rlhflab.envs.tools import SandboxUnavailable, python_sandbox

SRC = str(Path(__file__).resolve().parents[2] / "src")
SECRET = "rlhflab-secret-" + uuid.uuid4().hex


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    """A secret in the caller's environment (the trainer's API keys)."""
    monkeypatch.setenv("RLHFLAB_TEST_SECRET", SECRET)


def _caller(code: str, *, timeout_s: float, hang_s: float = 60, **kw) -> dict:
    """Run `python_sandbox(code)` from a separate process (the 'trainer', holding a secret in
    its environment): its result, whether it survived, and its peak-RSS growth (VmHWM) over the
    call. `hang_s` bounds the caller: a call that blocks returns {"hung": True}."""
    script = textwrap.dedent(
        f"""
        import json, sys
        from rlhflab.envs.tools import python_sandbox
        def hwm():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        python_sandbox("print(1)", **{kw!r})  # warm: imports, the isolation probe
        before = hwm()
        out = python_sandbox({code!r}, timeout_s={timeout_s!r}, **{kw!r})
        print(json.dumps({{"out": out, "hwm_growth_kb": hwm() - before}}))
        print("caller alive")
        """
    )
    env = {**os.environ, "PYTHONPATH": SRC, "RLHFLAB_TEST_SECRET": SECRET}
    try:
        res = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=hang_s
        )
    except subprocess.TimeoutExpired:
        return {"hung": True, "alive": False}
    lines = res.stdout.splitlines()
    out = json.loads(lines[0]) if lines and lines[0].startswith("{") else {}
    return {**out, "hung": False, "alive": "caller alive" in lines, "rc": res.returncode}


def _pids_with(marker: str) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker.encode() in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                pass
    return [pid for pid in pids if pid != os.getpid()]


def _gone(marker: str, within_s: float = 10.0) -> bool:
    end = time.monotonic() + within_s
    while _pids_with(marker) and time.monotonic() < end:
        time.sleep(0.1)
    return not _pids_with(marker)


# -- escapes of issue #37 ----------------------------------------------------------------------


def test_fork_exec_in_its_own_session_holding_the_pipe_is_killed_and_cannot_block(sandbox):
    # _posixsubprocess.fork_exec raises no audit event; the process starts its own session
    # (outside the killed process group) and inherits the output pipe.
    marker = "rlhflab-escape-" + uuid.uuid4().hex
    code = textwrap.dedent(
        f"""
        import _posixsubprocess, os, sys
        r, w = os.pipe()
        argv = [sys.executable, "-c", "import time; time.sleep(10**6)  # {marker}"]
        _posixsubprocess.fork_exec(argv, [os.fsencode(sys.executable)], False, (w,), None, None,
                                   -1, -1, -1, -1, -1, -1, r, w, True, True, -1, None, None,
                                   None, -1, None, False)
        print("started")
        """
    )
    try:
        res = _caller(code, timeout_s=2, hang_s=30, **sandbox)
        assert not res["hung"], "the tool call blocked on a process holding its output pipe"
        assert res["alive"]
        if not sandbox:  # the isolated sandbox kills the whole PID namespace at the end of a call
            assert _gone(marker), "a process the tool started outlived the call"
    finally:
        for pid in _pids_with(marker):  # leftovers of the unisolated run
            os.kill(pid, signal.SIGKILL)


def test_pidfd_signal_cannot_kill_the_caller(isolated):
    # only os.kill is an audit event: pidfd_send_signal reaches the parent without one
    code = "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), 9)"
    res = _caller(code, timeout_s=5)
    assert res["alive"] and res["rc"] == 0, res


def test_dir_fd_cannot_create_a_file_outside(sandbox, tmp_path):
    # os.open(name, flags, dir_fd=fd): the audit event carries the relative name only
    target = tmp_path / "escape_dir_fd.txt"
    code = (
        f"import os\nfd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
        "os.close(os.open('escape_dir_fd.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd))"
    )
    out = python_sandbox(code, **sandbox)
    assert out.startswith("error: ") and not target.exists(), out


def test_the_code_cannot_switch_the_write_rule_off(sandbox, tmp_path):
    # the old hook kept its settings in __main__'s globals
    target = tmp_path / "escape_main.txt"
    code = f"import __main__\n__main__._cwd = ''\nopen({str(target)!r}, 'w').write('x')"
    out = python_sandbox(code, **sandbox)
    assert out.startswith("error: ") and not target.exists(), out


def test_300_mb_of_output_does_not_grow_the_caller(sandbox):
    code = "import sys\nb = 'x' * (1 << 20)\nfor _ in range(300):\n    sys.stdout.write(b)"
    res = _caller(code, timeout_s=30, **sandbox)
    assert res["alive"] and res["out"] == "x" * tools.MAX_OUTPUT_CHARS
    assert res["hwm_growth_kb"] < 100 * 1024, res["hwm_growth_kb"]  # was ~890 MB


def test_host_files_are_unreachable_by_absolute_path(isolated, tmp_path):
    run_dir = tmp_path / "runs" / "grpo"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"secret: {SECRET}\n")
    (run_dir / "heldout_answers.jsonl").write_text(json.dumps({"answer": SECRET}) + "\n")
    for path in ["/etc/passwd", run_dir / "config.yaml", run_dir / "heldout_answers.jsonl"]:
        out = python_sandbox(f"print(open({str(path)!r}).read())")
        assert out.startswith("error: ") and SECRET not in out and "root:" not in out, out
    out = python_sandbox(f"import os\nprint(os.listdir({str(run_dir)!r}), os.listdir('/'))")
    assert out.startswith("error: ") and "config.yaml" not in out, out


# -- what held before and still holds ----------------------------------------------------------


def test_secrets_are_unreachable_proc_included(sandbox):
    code = textwrap.dedent(
        f"""
        import os
        print(dict(os.environ))
        for p in ["/proc/self/environ", f"/proc/{{os.getppid()}}/environ", "/proc/1/environ",
                  "/proc/{os.getpid()}/environ", "/proc/{os.getpid()}/cmdline"]:
            try:
                print(open(p, "rb").read())
            except Exception as exc:
                print(type(exc).__name__)
        """
    )
    out = python_sandbox(code, max_output_chars=100_000, **sandbox)
    assert SECRET not in out and out.count("\n") >= 5, out


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.system('true')",
        "import os\nwhile True:\n    os.fork()",
        "import subprocess\nsubprocess.run(['true'])",
        "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\nprint('connected')",
        "import ctypes\nctypes.CDLL(None)",
        "x = bytearray(10 * 1024**3)\nprint(len(x))",
    ],
    ids=["os.system", "fork", "subprocess", "socket", "ctypes", "10GB"],
)
def test_still_refused(sandbox, code):
    out = python_sandbox(code, timeout_s=10, **sandbox)
    assert out.startswith("error: ") and "\n" not in out and "connected" not in out, out


def test_the_work_directory_is_private_and_writable(sandbox):
    out = python_sandbox("open('a.txt', 'w').write('hi')\nprint(open('a.txt').read())", **sandbox)
    assert out == "hi"


# -- no isolation tool: refused unless env.tools.unsafe_local ----------------------------------


def test_without_isolation_code_is_refused_naming_the_setting(no_bwrap):
    with pytest.raises(SandboxUnavailable) as err:
        python_sandbox("print(1)")
    msg = str(err.value)
    assert "\n" not in msg and "env.tools.unsafe_local: true" in msg and "bwrap" in msg
    assert python_sandbox("print(1)", unsafe_local=True) == "1"


def test_environment_run_tool_refuses_then_unsafe_local_prints_one_line(no_bwrap):
    from rlhflab.envs import load_env
    from rlhflab.envs.tools import ToolCall

    env = load_env("rlhflab.envs.arithmetic:CalculatorEnv")
    with pytest.raises(SandboxUnavailable):
        env.run_tool(ToolCall("python", "print(2)"))
    lines = []
    env = load_env(
        "rlhflab.envs.arithmetic:CalculatorEnv", unsafe_local=True, print_fn=lines.append
    )
    assert len(lines) == 1 and "env.tools.unsafe_local" in lines[0] and "without" in lines[0]
    assert env.run_tool(ToolCall("python", "print(2)")) == "2"


@pytest.mark.slow
def test_unsafe_local_is_a_validated_config_field():
    from rlhflab.config import load_config
    from rlhflab.config.policy_gradient import EnvConfig
    from rlhflab.errors import ConfigError

    assert EnvConfig.model_validate({"class": "m:E"}).tools.unsafe_local is False
    cfg = EnvConfig.model_validate({"class": "m:E", "tools": {"unsafe_local": True}})
    assert cfg.tools.unsafe_local is True
    preset = Path(__file__).resolve().parents[2] / "configs" / "multiturn" / "calculator_grpo.yaml"
    with pytest.raises(ConfigError, match=r"env\.tools\.unsafe_local: .*boolean"):
        load_config(preset, ["env.tools.unsafe_local=1"])  # a security switch: true/false only


def test_a_root_caller_starts_bwrap_as_nobody_where_the_runtime_allows(isolated):
    # A root trainer whose Python runtime every user can read (here the system's /usr/bin/python3)
    # starts bwrap as host uid 65534: the code is unprivileged on the host too, and RLIMIT_NPROC
    # binds, so even fork_exec (no audit event) cannot start a process.
    system_python = shutil.which("python3", path="/usr/bin")
    if os.geteuid() != 0 or system_python is None:
        pytest.skip("needs a root caller and /usr/bin/python3")
    code = textwrap.dedent(
        """
        import _posixsubprocess, os, sys
        r, w = os.pipe()
        _posixsubprocess.fork_exec([sys.executable, "-c", "pass"], [os.fsencode(sys.executable)],
                                   False, (w,), None, None, -1, -1, -1, -1, -1, -1, r, w, True,
                                   True, -1, None, None, None, -1, None, False)
        print("started")
        """
    )
    script = (
        "import json, sys\nfrom rlhflab.envs import tools\n"
        f"print(json.dumps([tools.sandbox_isolation(), tools.python_sandbox({code!r})]))"
    )
    env = {**os.environ, "PYTHONPATH": SRC, "RLHFLAB_TEST_SECRET": SECRET}
    res = subprocess.run(
        [system_python, "-c", script], capture_output=True, text=True, env=env, timeout=60
    )
    if res.returncode != 0 and "Error" in res.stderr and "import" in res.stderr.lower():
        pytest.skip(f"rlhflab.envs.tools does not import under {system_python}")
    how, out = json.loads(res.stdout)
    assert how.startswith("bwrap started as uid 65534"), how
    assert out.startswith("error: ") and "started" not in out, out

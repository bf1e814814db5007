"""Tools a multi-turn environment can give the model: tool-call parsing, a calculator and a
sandboxed Python executor.

Tool-call formats (`parse_tool_call`), first match wins:
- tagged, for rlhflab's from-scratch models: ``<tool>calc: 12*34</tool>`` (tool name, a colon,
  its input);
- the Hermes / Qwen chat templates' format: ``<tool_call>{"name": "calc", "arguments":
  {"expression": "12*34"}}</tool_call>`` (the first string argument is the tool's input).

Model output never runs in the trainer's process: `calculator` only walks an `ast` of numbers and
arithmetic operators (no `eval`), with bounded sizes; `python_sandbox` runs code in a fresh
bubblewrap sandbox (its own user, PID, mount and network namespaces; only a read-only Python
runtime and a private tmpfs) under resource limits, and refuses to run it where no such
isolation works unless told `unsafe_local` (see its docstring, and docs/multiturn.md for the
threat model). Every tool returns one string: its output, or a one-line error (`"error: ..."`);
none raises on bad model input.
"""

from __future__ import annotations

import ast
import contextlib
import json
import operator
import os
import re
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

from rlhflab.errors import RlhfLabError

__all__ = [
    "TOOLS",
    "SandboxUnavailable",
    "ToolCall",
    "calculator",
    "check_sandbox",
    "parse_tool_call",
    "python_sandbox",
    "sandbox_isolation",
]


@dataclass(frozen=True)
class ToolCall:
    """A parsed tool call: the tool's `name` and its one string `input`."""

    name: str
    input: str


_TAGGED = re.compile(r"<tool>\s*([A-Za-z_][\w-]*)\s*:(.*?)</tool>", re.S)
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_tool_call(text: str) -> ToolCall | None:
    """The first tool call in a model turn's text, or None when it has none.

    Accepts ``<tool>name: input</tool>`` and ``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`` (arguments a dict whose first string value is the input, or a string).
    A `<tool_call>` block that is not such JSON counts as no call."""
    m = _TAGGED.search(text)
    if m:
        return ToolCall(m.group(1), m.group(2).strip())
    m = _HERMES.search(text)
    if m:
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", "")
        if isinstance(args, str):
            try:  # some templates write the arguments as a JSON string
                args = json.loads(args)
            except ValueError:
                return ToolCall(obj["name"], args)
        if isinstance(args, dict):
            first = next((v for v in args.values() if isinstance(v, str)), "")
            return ToolCall(obj["name"], first)
        return ToolCall(obj["name"], str(args))
    return None


# -- Calculator ------------------------------------------------------------------------------

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 60  # |integer results| < 10^60
MAX_EXPONENT = 64


class _CalcError(ValueError):
    pass


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression safely: integers and decimals, + - * / // % ** and
    parentheses, walked on its `ast` (never `eval`). Bounds: at most 200 characters, integer
    results below 10^60 in absolute value, exponents at most 64. An integral result prints as an
    integer ("408"), a fractional one with up to 12 significant digits ("0.333333333333").

    Returns the result, or a one-line "error: ..." (syntax, a name or call, division by zero,
    a bound exceeded); never raises."""
    expression = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        tree = ast.parse(expression, mode="eval")
        value = _calc(tree.body)
    except SyntaxError:
        return "error: not an arithmetic expression"
    except ZeroDivisionError:
        return "error: division by zero"
    except (_CalcError, OverflowError) as exc:
        return f"error: {exc}"
    if isinstance(value, float):
        if value == int(value) and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def _calc(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_calc(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _calc(node.left), _calc(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise _CalcError(f"exponent larger than {MAX_EXPONENT}")
        return _bounded(_BINOPS[type(node.op)](left, right))
    raise _CalcError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")


def _bounded(value):
    if isinstance(value, complex):
        raise _CalcError("complex result")
    if abs(value) >= 10**MAX_DIGITS:
        raise _CalcError(f"result has more than {MAX_DIGITS} digits")
    return value


# -- Python sandbox --------------------------------------------------------------------------

MAX_OUTPUT_CHARS = 2000
SANDBOX_DIR = "/sandbox"  # the code's working directory inside the isolated sandbox (a tmpfs)
SANDBOX_UID = 65534  # "nobody": the code's user inside the sandbox
WORKDIR_BYTES = 64 << 20  # size of the sandbox's writable tmpfs (where bwrap supports --size)
STDERR_TAIL_BYTES = 4096  # of the child's stderr only the last bytes are kept (the error line)
KILL_WAIT_S = 5.0  # after SIGKILL, the longest wait for the sandbox's process to be reaped
UNSAFE_SETTING = "env.tools.unsafe_local: true"


class SandboxUnavailable(RlhfLabError):
    """No working OS isolation (bubblewrap) for the python tool, and `env.tools.unsafe_local`
    is not set: model-written code is refused (the message says why and names the setting)."""


# Runs in the child before the model's code: the code comes on stdin; then RLIMIT_NPROC 0 and an
# audit hook (PEP 578, the second layer under the OS isolation) refusing process creation and
# signals, sockets, ctypes, writes outside the working directory, opening directories outside it
# (so no `dir_fd` escapes) and gc's object walks. Its settings are
# literals in its own code, in a namespace of its own with a private copy of the builtins, not
# names the model's code can rebind (`__main__` holds nothing of it). It is still Python: code
# written to defeat it can (e.g. through the hook's frame in a traceback). `__CWD__` is
# replaced by the working directory.
_CHILD = r"""
import sys
_code = sys.stdin.read()
def _arm():
    import builtins, os, resource
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    except (ValueError, OSError):
        pass
    g = {"__builtins__": dict(builtins.__dict__), "os": os, "realpath": os.path.realpath,
         "fsdecode": os.fsdecode, "isdir": os.path.isdir, "PathLike": os.PathLike}
    exec(compile(_HOOK, "<sandbox>", "exec"), g)
    sys.addaudithook(g["hook"])
_HOOK = '''
W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATHS = frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                   "os.symlink", "os.link", "os.truncate", "os.utime", "shutil.rmtree",
                   "shutil.move", "shutil.copyfile", "os.chroot"})
PROC = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
        "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn", "signal.pthread_kill")
DENY = ("socket.", "ctypes.", "mmap.__new__", "gc.get_referrers", "gc.get_referents",
        "gc.get_objects", "sys.settrace", "sys.setprofile", "sys.addaudithook",
        "function.__new__")
def inside(path):
    try:
        p = realpath(fsdecode(path))
    except Exception:
        return False
    return p == __CWD__ or p.startswith(__CWD__ + "/") or p == "/dev/null"
def hook(event, args):
    if event.startswith(PROC) or event.startswith(DENY):
        raise PermissionError(f"{event} is not allowed in the sandbox")
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int):
            return
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & W)
        if (writing or (mode is None and isdir(path))) and not inside(path):
            what = "writing" if writing else "opening a directory"
            raise PermissionError(f"{what} outside the sandbox directory is refused: {path}")
    elif event in PATHS:
        for a in args:
            if isinstance(a, (str, bytes, PathLike)) and not inside(a):
                raise PermissionError(f"{event} outside the sandbox directory is refused: {a}")
'''
_arm()
del _arm, _HOOK
try:
    exec(compile(_code, "<tool>", "exec"), {"__name__": "__main__"})
except BaseException as exc:
    sys.stdout.flush()
    msg = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    print(msg.splitlines()[0][:300], file=sys.stderr)
    sys.exit(1)
"""


def _child_script(workdir: str) -> str:
    return _CHILD.replace("__CWD__", repr(workdir))


@dataclass
class _Outcome:
    out: bytes  # stdout, at most the cap
    err: bytes  # the last STDERR_TAIL_BYTES of stderr
    returncode: int | None  # None: the process could not be reaped
    timed_out: bool
    capped: bool  # stdout reached the cap (the process was killed then)


def _run_child(
    argv: list[str],
    code: bytes,
    *,
    cwd: str | None,
    env: dict[str, str],
    limits: dict[int, tuple[int, int]],
    timeout_s: float,
    out_cap: int,
    run_as: int | None = None,
) -> _Outcome:
    """Start `argv` in a new session under `limits`, feed `code` on stdin and read stdout and
    stderr as they arrive (stdout kept up to `out_cap` bytes: the child is killed when it
    reaches it; stderr: its last bytes only), all within `timeout_s` of wall-clock time. Then
    the child's whole process group is killed and the child reaped (waiting at most
    KILL_WAIT_S): no wait is unbounded, and a process that keeps a pipe open cannot hold the
    caller. Raises OSError when the child cannot be started."""

    def preexec() -> None:  # in the child, after the uid/gid change, before exec
        for which, value in limits.items():
            resource.setrlimit(which, value)

    drop = {} if run_as is None else {"user": run_as, "group": run_as, "extra_groups": []}
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=preexec,
        start_new_session=True,
        **drop,
    )
    out, err = bytearray(), bytearray()
    timed_out = capped = False
    pending = memoryview(code)
    sel = selectors.DefaultSelector()
    try:
        for f in (proc.stdin, proc.stdout, proc.stderr):
            os.set_blocking(f.fileno(), False)
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        if pending:
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while len(sel.get_map()) and not capped:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(left):
                f = key.fileobj
                if f is proc.stdin:
                    try:
                        n = os.write(f.fileno(), pending[:65536])
                    except BlockingIOError:
                        continue
                    except OSError:  # the child stopped reading: the rest is dropped
                        n = len(pending)
                    pending = pending[n:]
                    if not pending:
                        sel.unregister(f)
                        f.close()
                    continue
                try:
                    chunk = os.read(f.fileno(), 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(f)
                elif f is proc.stdout:
                    out += chunk[: out_cap - len(out)]
                    capped = len(out) >= out_cap
                else:
                    err += chunk
                    del err[:-STDERR_TAIL_BYTES]
        if not (timed_out or capped):  # both pipes closed: the exit, within the deadline
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        sel.close()
        _kill_group(proc)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                f.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(KILL_WAIT_S)
    return _Outcome(bytes(out), bytes(err), proc.returncode, timed_out, capped)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (it leads its own session) and the child itself.
    Under bubblewrap the child is bwrap: its death kills the sandbox's PID 1
    (`--die-with-parent`), and with it every process of the PID namespace."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        proc.kill()


def _interpreter() -> str:
    """The Python the sandbox runs: this interpreter's real file (a venv's `python` is a link
    to its base installation, whose standard library is all the sandbox gets)."""
    return os.path.realpath(sys.executable)


def _reachable_by_all(path: str) -> bool:
    """Every directory on the way to `path` is searchable by any user, and `path` readable."""
    p = os.path.abspath(path)
    try:
        if not os.stat(p).st_mode & stat.S_IROTH:
            return False
        while p != "/":
            p = os.path.dirname(p)
            if not os.stat(p).st_mode & stat.S_IXOTH:
                return False
    except OSError:
        return False
    return True


def _runtime_binds() -> tuple[list[str], list[str]]:
    """bwrap arguments that bind the Python runtime read-only (the base installation's prefix,
    its standard library; the system's shared-library directories), with the base
    installation's site-packages hidden under an empty read-only tmpfs; and the host paths
    bound."""
    base = os.path.realpath(sys.base_prefix)
    exe = _interpreter()
    args: list[str] = []
    sources = []
    for d in (base, *([] if exe.startswith(base + os.sep) else [os.path.dirname(exe)])):
        args += ["--ro-bind", d, d]
        sources.append(d)
    for d in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32"):
        if d == base or d.startswith(base + os.sep):
            continue  # bound with the base installation
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
            sources.append(d)
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    scheme_vars = {"base": base, "platbase": base, "installed_base": base}
    hidden = {sysconfig.get_path(k, vars=scheme_vars) for k in ("purelib", "platlib")}
    for d in sorted(hidden):
        if os.path.isdir(d) and d.startswith(base + os.sep):
            args += ["--tmpfs", d, "--remount-ro", d]
    return args, sources


def _limits(cpu_s: int, memory_mb: int) -> dict[int, tuple[int, int]]:
    """The rlimits of a call: CPU seconds, address space, file size, open files, no cores."""
    return {
        resource.RLIMIT_CPU: (cpu_s, cpu_s + 1),
        resource.RLIMIT_AS: (memory_mb << 20, memory_mb << 20),
        resource.RLIMIT_FSIZE: (16 << 20, 16 << 20),
        resource.RLIMIT_NOFILE: (64, 64),
        resource.RLIMIT_CORE: (0, 0),
    }


@dataclass(frozen=True)
class _Bwrap:
    argv: tuple[str, ...]  # bwrap and its options, up to the command
    run_as: int | None  # host uid/gid bwrap is started as (root trainer, runtime readable by all)


def _bwrap_argv(exe: str, features: str, run_as: int | None) -> list[str]:
    binds, _ = _runtime_binds()
    argv = [exe, "--unshare-all", "--unshare-user"]
    if "--disable-userns" in features:
        argv.append("--disable-userns")  # no nested user namespaces inside
    argv += ["--die-with-parent", "--new-session", "--uid", str(SANDBOX_UID)]
    argv += ["--gid", str(SANDBOX_UID), "--hostname", "sandbox"]
    if run_as is None and os.geteuid() == 0:
        argv += ["--cap-drop", "ALL"]
    argv += ["--tmpfs", "/", *binds, "--dev", "/dev"]
    if "--size" in features:
        argv += ["--size", str(WORKDIR_BYTES)]
    argv += ["--tmpfs", SANDBOX_DIR, "--chdir", SANDBOX_DIR, "--remount-ro", "/dev"]
    argv += ["--remount-ro", "/", "--clearenv"]
    argv += ["--setenv", "HOME", SANDBOX_DIR, "--setenv", "TMPDIR", SANDBOX_DIR]
    argv += ["--setenv", "PATH", "/usr/bin:/bin"]
    return argv


@lru_cache(maxsize=1)
def _isolation() -> _Bwrap | str:
    """The bubblewrap set-up when it can run the sandbox here (checked by running
    `print("ok")` in it once per process), else why not (one line)."""
    exe = shutil.which("bwrap")
    if exe is None:
        return "bubblewrap (bwrap) is not installed"
    try:
        features = subprocess.run([exe, "--help"], capture_output=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap --help failed: {exc}"
    features = features.decode("utf-8", "replace")
    candidates = []
    if os.geteuid() == 0 and all(_reachable_by_all(d) for d in _runtime_binds()[1]):
        candidates.append(SANDBOX_UID)  # a root trainer starts bwrap as nobody where it can
    candidates.append(None)
    why = ""
    # --disable-userns needs a kernel that lets bwrap cap nested namespaces: tried first
    tries = [
        (r, f) for r in candidates for f in (features, features.replace("--disable-userns", ""))
    ]
    for run_as, feats in dict.fromkeys(tries):
        argv = _bwrap_argv(exe, feats, run_as)
        cmd = [*argv, _interpreter(), "-I", "-S", "-c", _child_script(SANDBOX_DIR)]
        try:
            res = _run_child(cmd, b"print('ok')", cwd="/", env={"PATH": "/usr/bin:/bin"},
                             limits=_limits(2, 512), timeout_s=20, out_cap=64,
                             run_as=run_as)  # fmt: skip
        except OSError as exc:
            why = f"bwrap could not start: {exc}"
            continue
        if res.returncode == 0 and res.out.strip() == b"ok":
            return _Bwrap(tuple(argv), run_as)
        lines = res.err.decode("utf-8", "replace").strip().splitlines()
        why = lines[-1] if lines else f"exit code {res.returncode}"
    return f"bwrap cannot create the sandbox here ({why})"


@lru_cache(maxsize=1)
def _net_isolation() -> list[str]:
    """`unshare -rn` (a new user and network namespace: no interface but loopback) when it works
    here, else [] (then only the audit hook refuses sockets). The unsafe_local path only."""
    exe = shutil.which("unshare")
    if exe is None:
        return []
    try:
        probe = [exe, "-rn", _interpreter(), "-I", "-S", "-c", ""]  # no PATH lookup inside
        ok = subprocess.run(probe, capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [exe, "-rn"] if ok else []


def sandbox_isolation() -> str:
    """How the python tool isolates model-written code here, in words (for logs and docs)."""
    iso = _isolation()
    if isinstance(iso, str):
        return f"none: {iso}; only with {UNSAFE_SETTING}: rlimits + audit hook" + (
            " + network namespace (unshare -rn)" if _net_isolation() else ""
        )
    who = "bwrap started as uid 65534" if iso.run_as is not None else "bwrap"
    return (
        f"{who}: new user, PID, mount, network, IPC and UTS namespaces, uid {SANDBOX_UID} inside "
        "with no capabilities, read-only Python runtime, private tmpfs; rlimits; audit hook"
    )


def check_sandbox(unsafe_local: bool = False) -> str:
    """Whether the python tool can run model-written code here: the one-line description of the
    isolation used (`sandbox_isolation`).

    Raises:
        SandboxUnavailable: bubblewrap cannot isolate the code here and `unsafe_local` is False
            (the message names the reason and the `env.tools.unsafe_local` setting)."""
    iso = _isolation()
    if isinstance(iso, str) and not unsafe_local:
        raise SandboxUnavailable(
            f"the python tool refuses to run model-written code without OS isolation: {iso}. "
            "Install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; it needs "
            f"unprivileged user namespaces, docs/multiturn.md), or set {UNSAFE_SETTING} to run "
            "it unisolated (rlimits and an audit hook only)"
        )
    return sandbox_isolation()


def python_sandbox(
    code: str,
    *,
    timeout_s: float = 5.0,
    cpu_s: int = 2,
    memory_mb: int = 512,
    max_output_chars: int = MAX_OUTPUT_CHARS,
    unsafe_local: bool = False,
) -> str:
    """Run Python `code` in a fresh, OS-isolated process and return its stdout (then, on failure,
    the one-line error). Never runs the code in this process; never raises on anything the code
    does. The threat model and what each layer stops: docs/multiturn.md.

    Isolation (bubblewrap, `bwrap`): new user, PID, mount, network, IPC and UTS namespaces; uid
    65534 inside with no capabilities (`--cap-drop ALL`; bwrap is started as host uid 65534
    too when the caller is root and the Python runtime is readable by all); a file system of
    only the Python runtime (this interpreter's base installation with its site-packages
    hidden, and the shared-library directories), read-only, plus a private 64 MB tmpfs at
    /sandbox as the working directory (of /etc only ld.so.cache; no /proc, /tmp, home or run
    directory of the host); an empty environment; `--die-with-parent` and `--new-session`. The child runs
    `python -I -S`.

    Limits: CPU time `cpu_s` (RLIMIT_CPU: "error: killed (CPU time limit)"); wall-clock
    `timeout_s` ("error: timed out after ...s"); address space `memory_mb` (RLIMIT_AS: a large
    allocation raises MemoryError); files at most 16 MB (RLIMIT_FSIZE), 64 open files;
    RLIMIT_NPROC 0 in the child (binds where the host uid is not root); stdout read as it
    arrives and the child killed once it has written more than 4 × `max_output_chars` bytes;
    only the last 4 KB of stderr kept. At the end of every call the process group is killed
    and, under bwrap, the whole PID namespace with it; every wait is bounded. Output beyond
    `max_output_chars` is cut. A second layer inside the child, an audit hook (PEP 578), refuses
    process creation, os.kill, sockets, ctypes, writes and directory opens outside the working
    directory, and gc's object walks; it is not a boundary on its own.

    Raises:
        SandboxUnavailable: bubblewrap cannot isolate the code here and `unsafe_local` is
            False. With `unsafe_local` (`env.tools.unsafe_local: true`) the code runs without
            OS isolation: a child process in a temporary host directory with the same rlimits,
            output cap and audit hook, in a network namespace (`unshare -rn`) where that works.
    """
    iso = _isolation()
    if isinstance(iso, str):
        check_sandbox(unsafe_local)
    limits = _limits(cpu_s, memory_mb)
    source = code.encode("utf-8", "replace")
    out_cap = 4 * max_output_chars + 4
    with contextlib.ExitStack() as stack:
        if isinstance(iso, _Bwrap):
            argv = [*iso.argv, _interpreter(), "-I", "-S", "-c", _child_script(SANDBOX_DIR)]
            cwd, env, run_as = "/", {"PATH": "/usr/bin:/bin"}, iso.run_as
        else:  # unsafe_local: no OS isolation (docs/multiturn.md)
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="rlhflab-sandbox-"))
            tmp = os.path.realpath(tmp)
            argv = [*_net_isolation(), _interpreter(), "-I", "-S", "-c", _child_script(tmp)]
            cwd, env, run_as = tmp, {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp}, None
        try:
            res = _run_child(argv, source, cwd=cwd, env=env, limits=limits,
                             timeout_s=timeout_s, out_cap=out_cap, run_as=run_as)  # fmt: skip
        except OSError as exc:
            return f"error: could not start the sandbox: {exc}"
    if res.timed_out:
        return f"error: timed out after {timeout_s:g}s"
    text = res.out.decode("utf-8", "replace")
    if res.capped:
        return text[:max_output_chars].rstrip("\n")
    rc = res.returncode
    if rc is None:
        text += "error: the sandbox did not exit"
    elif rc != 0:
        # bwrap reports a child killed by signal N as exit code 128 + N
        sig = -rc if rc < 0 else rc - 128 if isinstance(iso, _Bwrap) and rc > 128 else 0
        if sig:
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            why = "CPU time limit" if name == "SIGXCPU" else name
            text += f"error: killed ({why})"
        else:
            lines = res.err.decode("utf-8", "replace").strip().splitlines()
            text += f"error: {lines[-1] if lines else f'exit code {rc}'}"
    return text[:max_output_chars].rstrip("\n")


#: Tools by the name a tool call uses: a function str -> str.
TOOLS = {"calc": calculator, "calculator": calculator, "python": python_sandbox}

"""Tools a multi-turn environment can give the model: tool-call parsing, a calculator and a
sandboxed Python executor.

Tool-call formats (`parse_tool_call`), first match wins:
- tagged, for rlhflab's from-scratch models: ``<tool>calc: 12*34</tool>`` (tool name, a colon,
  its input);
- the Hermes / Qwen chat templates' format: ``<tool_call>{"name": "calc", "arguments":
  {"expression": "12*34"}}</tool_call>`` (the first string argument is the tool's input).

Model output never runs in the trainer's process: `calculator` only walks an `ast` of numbers and
arithmetic operators (no `eval`), with bounded sizes; `python_sandbox` runs code in a child
process under resource limits (see its docstring for each limit and how it is enforced). Every
tool returns one string: its output, or a one-line error (`"error: ..."`); none raises on bad
model input.
"""

from __future__ import annotations

import ast
import contextlib
import json
import operator
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["TOOLS", "ToolCall", "calculator", "parse_tool_call", "python_sandbox"]


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

# Runs in the child before the model's code: an audit hook (PEP 578) that refuses process
# creation, sockets, ctypes and writes outside the working directory. The code comes on stdin.
_CHILD = r"""
import os, sys
_cwd = os.path.realpath(os.getcwd())
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                "os.symlink", "os.link", "os.truncate", "os.utime", "shutil.rmtree",
                "shutil.move", "shutil.copyfile"}
_PROC_EVENTS = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn")
def _inside(path):
    try:
        p = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else "")
    except Exception:
        return False
    return p == _cwd or p.startswith(_cwd + os.sep)
def _hook(event, args):
    if event.startswith(_PROC_EVENTS):
        raise PermissionError(f"{event} is not allowed in the sandbox")
    if event.startswith(("socket.", "ctypes.")) or event in ("mmap.__new__",):
        raise PermissionError(f"{event} is not allowed in the sandbox (no network, no ctypes)")
    if event == "open":
        path, mode, flags = args
        if isinstance(path, int):
            return
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writing and not _inside(path):
            raise PermissionError(f"writing outside the sandbox directory is refused: {path}")
    elif event in _PATH_EVENTS:
        for a in args:
            if isinstance(a, (str, bytes, os.PathLike)) and not _inside(a):
                raise PermissionError(f"{event} outside the sandbox directory is refused: {a}")
code = sys.stdin.read()
sys.addaudithook(_hook)
try:
    exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
except BaseException as exc:
    sys.stdout.flush()
    msg = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    print(msg.splitlines()[0][:300], file=sys.stderr)
    sys.exit(1)
"""


@lru_cache(maxsize=1)
def _net_isolation() -> list[str]:
    """`unshare -rn` (a new user and network namespace: no interface but loopback) when it works
    here, else [] (then only the audit hook refuses sockets)."""
    exe = shutil.which("unshare")
    if exe is None:
        return []
    try:
        ok = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [exe, "-rn"] if ok else []


def sandbox_isolation() -> str:
    """How the sandbox keeps the network away, in words (for logs and docs)."""
    if _net_isolation():
        return "network namespace (unshare -rn) + audit hook refusing sockets"
    return "audit hook refusing sockets (unshare not available)"


def python_sandbox(
    code: str,
    *,
    timeout_s: float = 5.0,
    cpu_s: int = 2,
    memory_mb: int = 512,
    max_output_chars: int = MAX_OUTPUT_CHARS,
) -> str:
    """Run Python `code` in a child process and return its stdout (then, on failure, the one-line
    error). Never runs the code in this process; never raises on anything the code does.

    Limits: CPU time `cpu_s` (RLIMIT_CPU) and wall-clock `timeout_s` (the child's process group
    is killed; "error: timed out after ...s"); address space `memory_mb` (RLIMIT_AS: a large
    allocation raises MemoryError in the child); no new processes (RLIMIT_NPROC 0, which binds
    where the user is not root or inside the user namespace, and an audit hook refusing
    os.fork / exec / subprocess / os.system); no network (a new network namespace via
    `unshare -rn` where that works, and always an audit hook refusing socket creation and
    ctypes); a fresh temporary working directory, removed afterwards; writes (open for
    writing, rename, remove, mkdir, ...) outside that directory refused by the audit hook;
    files at most 16 MB (RLIMIT_FSIZE), 64 open files. The child runs `python -I -S` (isolated:
    no user site, no PYTHON* variables) with an empty environment. Output beyond
    `max_output_chars` is cut.

    An audit hook is not a security boundary against code written to escape it; the process,
    the rlimits and the namespace are what hold against an accident or a runaway program."""
    limits = {
        resource.RLIMIT_CPU: (cpu_s, cpu_s + 1),
        resource.RLIMIT_AS: (memory_mb << 20, memory_mb << 20),
        resource.RLIMIT_FSIZE: (16 << 20, 16 << 20),
        resource.RLIMIT_NOFILE: (64, 64),
        resource.RLIMIT_CORE: (0, 0),
    }

    def preexec() -> None:  # in the child, before exec
        for which, value in limits.items():
            resource.setrlimit(which, value)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))

    cmd = [*_net_isolation(), sys.executable, "-I", "-S", "-c", _CHILD]
    with tempfile.TemporaryDirectory(prefix="rlhflab-sandbox-") as tmp:
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=tmp,
                env={"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                preexec_fn=preexec,
                start_new_session=True,
            )
        except OSError as exc:
            return f"error: could not start the sandbox: {exc}"
        try:
            out, err = proc.communicate(code.encode("utf-8", "replace"), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return f"error: timed out after {timeout_s:g}s"
        _kill_group(proc)  # anything the code left behind in its session
    text = out.decode("utf-8", "replace")
    if proc.returncode != 0:
        lines = err.decode("utf-8", "replace").strip().splitlines()
        if proc.returncode < 0:
            sig = signal.Signals(-proc.returncode).name
            why = "CPU time limit" if sig == "SIGXCPU" else sig
            text += f"error: killed ({why})"
        else:
            text += f"error: {lines[-1] if lines else f'exit code {proc.returncode}'}"
    return text[:max_output_chars].rstrip("\n")


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


#: Tools by the name a tool call uses: a function str -> str.
TOOLS = {"calc": calculator, "calculator": calculator, "python": python_sandbox}

"""Tools of multi-turn environments: tool-call parsing, the calculator (an `ast` walk, never
`eval`) and the Python sandbox's limits (each hostile program fails with a one-line result)."""

import os

import pytest

from rlhflab.envs.tools import ToolCall, calculator, parse_tool_call, python_sandbox


@pytest.mark.parametrize(
    ("text", "call"),
    [
        ("I will compute <tool>calc: 12*34</tool>", ToolCall("calc", "12*34")),
        ("<tool>python:\nprint(1)\n</tool> then", ToolCall("python", "print(1)")),
        ('<tool_call>{"name": "calc", "arguments": {"expression": "1+2"}}</tool_call>',
         ToolCall("calc", "1+2")),
        ('<tool_call>{"name": "calc", "arguments": "{\\"x\\": \\"7*6\\"}"}</tool_call>',
         ToolCall("calc", "7*6")),
        ("<answer>408</answer>", None),
        ("<tool_call>not json</tool_call>", None),
        ("<tool>no colon</tool>", None),
    ],
)  # fmt: skip
def test_parse_tool_call(text, call):
    assert parse_tool_call(text) == call


@pytest.mark.parametrize(
    ("expr", "out"),
    [
        ("12*34", "408"),
        ("(3+4)*5-1", "34"),
        ("123456789*987654321", str(123456789 * 987654321)),
        ("10/4", "2.5"),
        ("10/2", "5"),
        ("7//2", "3"),
        ("2**10", "1024"),
        ("-3 + +2", "-1"),
        ("12 × 3", "36"),
    ],
)
def test_calculator_values(expr, out):
    assert calculator(expr) == out


@pytest.mark.parametrize(
    "expr",
    ["__import__('os').system('true')", "x + 1", "1/0", "2**100000", "9**9**9",
     "(1,2)", "1 if 1 else 2", "'a' * 3", "[1]*10", "1" * 300, "10**59 * 10**59"],
)  # fmt: skip
def test_calculator_refuses_with_one_line(expr):
    out = calculator(expr)
    assert out.startswith("error: ") and "\n" not in out


def test_sandbox_runs_code_in_a_temporary_directory(sandbox):
    out = python_sandbox(
        "import os\nopen('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), os.getcwd())",
        **sandbox,
    )
    text, cwd = out.split()
    assert text == "hi" and cwd != os.getcwd() and not os.path.exists(cwd)  # removed afterwards


HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "subprocess": "import subprocess\nsubprocess.run(['true'])",
    "10 GB allocation": "x = bytearray(10 * 1024**3)\nprint(len(x))",
    "network": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\nprint('connected')",
    "write outside": "open('/tmp/rlhflab_sandbox_escape.txt', 'w').write('x')",
    "rename outside": "import os\nopen('a', 'w').close()\nos.rename('a', '/tmp/rlhflab_sandbox_escape.txt')",
    "ctypes": "import ctypes\nctypes.CDLL(None)",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_sandbox_refuses_cleanly(name, sandbox):
    out = python_sandbox(HOSTILE[name], timeout_s=10, **sandbox)
    assert out.startswith("error: "), out
    assert "\n" not in out and "connected" not in out
    assert not os.path.exists("/tmp/rlhflab_sandbox_escape.txt")


def test_sandbox_kills_an_infinite_loop(sandbox):
    out = python_sandbox("while True:\n    pass", timeout_s=1.0, cpu_s=1, **sandbox)
    assert out.startswith("error: ") and ("timed out" in out or "CPU time" in out), out


def test_sandbox_reports_the_exception_in_one_line(sandbox):
    out = python_sandbox("print(1)\nraise ValueError('bad\\nthing')", **sandbox)
    assert out == "1\nerror: ValueError: bad"

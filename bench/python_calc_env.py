"""The calculator environment with every calculator call run as Python code in the python tool's
sandbox (`rlhflab.envs.tools.python_sandbox`): a full multi-turn run that exercises the sandbox
once per tool call (bench/multiturn_calculator.py --calc-tool python).

The expression is first checked by the calculator (its `ast` walk and bounds; a refused one
returns the calculator's error, as in CalculatorEnv); an accepted one is evaluated in the sandbox
and printed in the calculator's format, so the sandbox's output equals the calculator's and a run
with either sandbox is the run with the plain calculator, episode for episode, as long as every
sandbox call succeeds. `STATS` counts calls, the calls whose output differed
from the calculator's (sandbox failures) and the seconds spent in the sandbox.

Works with any rlhflab version whose `python_sandbox(code, timeout_s=...)` exists (the bench
compares sandboxes by running the same env on two versions).
"""

from __future__ import annotations

import time

from rlhflab.envs.arithmetic import CalculatorEnv
from rlhflab.envs.tools import calculator, python_sandbox

PROGRAM = """v = ({expr})
if isinstance(v, float):
    print(int(v) if v == int(v) and abs(v) < 1e15 else f"{{v:.12g}}")
else:
    print(v)
"""

STATS = {"calls": 0, "mismatches": 0, "sandbox_s": 0.0, "examples": []}


class PythonCalculatorEnv(CalculatorEnv):
    """CalculatorEnv whose `calc` tool runs in the python sandbox (see the module docstring)."""

    def run_tool(self, call):
        if call.name not in ("calc", "calculator"):
            return super().run_tool(call)
        expected = calculator(call.input)
        if expected.startswith("error: "):
            return expected
        expr = call.input.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
        t0 = time.perf_counter()
        out = python_sandbox(PROGRAM.format(expr=expr), timeout_s=self.tool_timeout_s)
        s = STATS
        s["sandbox_s"] += time.perf_counter() - t0
        s["calls"] += 1
        if out != expected:
            s["mismatches"] += 1
            if len(s["examples"]) < 5:
                s["examples"].append({"expr": expr, "sandbox": out, "calculator": expected})
        return out

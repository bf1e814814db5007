"""Per-call cost of the python tool's sandbox: N calls of a trivial program (`print(6 * 7)`) in
each mode, interleaved call by call (so load on a shared machine hits every mode alike), and
the median and 90th percentile in milliseconds per call (wall-clock, the caller's view).

Modes:
- `isolated`: `python_sandbox` as the trainer calls it (bubblewrap; see docs/multiturn.md);
- `unsafe_local`: `python_sandbox(..., unsafe_local=True)` with bwrap hidden from PATH (no OS
  isolation: rlimits, audit hook, `unshare -rn` where it works);
- `before`: the previous `python_sandbox` (audit hook + `unshare -rn`), loaded from the file
  `--before-tools` (e.g. `git show <rev>:src/rlhflab/envs/tools.py > /tmp/tools_before.py`);
- `bare`: `python -I -S -c 'print(6 * 7)'` with subprocess.run, no sandbox: the floor.

Usage:
    python -m bench.sandbox_overhead --n 200 --before-tools /tmp/tools_before.py \
        --out bench/sandbox_overhead.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CODE = "print(6 * 7)"


def _percentile(xs: list[float], q: float) -> float:
    """The q-quantile by linear interpolation between order statistics (numpy's default)."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _modes(before_tools: Path | None) -> dict:
    from rlhflab.envs import tools

    exe = os.path.realpath(sys.executable)
    modes = {
        "isolated": lambda: tools.python_sandbox(CODE),
        "bare": lambda: subprocess.run(
            [exe, "-I", "-S", "-c", CODE], capture_output=True, text=True, timeout=30
        ).stdout.strip(),
    }
    if before_tools is not None:
        spec = importlib.util.spec_from_file_location("tools_before", before_tools)
        before = sys.modules["tools_before"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
        modes["before"] = lambda: before.python_sandbox(CODE)
    return modes


def _unsafe_tools():
    """A second copy of rlhflab.envs.tools whose isolation probe ran with bwrap hidden from
    PATH (`unshare` kept), so its calls take the unsafe_local path."""
    from rlhflab.envs import tools

    spec = importlib.util.spec_from_file_location("tools_unsafe", tools.__file__)
    mod = sys.modules["tools_unsafe"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    no_bwrap = tempfile.mkdtemp(prefix="rlhflab-nobwrap-")
    if tools.shutil.which("unshare"):
        os.symlink(tools.shutil.which("unshare"), os.path.join(no_bwrap, "unshare"))
    path = os.environ["PATH"]
    os.environ["PATH"] = no_bwrap
    try:
        mod.sandbox_isolation()  # runs and caches both probes
    finally:
        os.environ["PATH"] = path
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="calls per mode")
    ap.add_argument("--before-tools", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("bench/sandbox_overhead.json"))
    args = ap.parse_args()
    from rlhflab.envs import tools

    modes = _modes(args.before_tools)
    tools_unsafe = _unsafe_tools()
    modes["unsafe_local"] = lambda: tools_unsafe.python_sandbox(CODE, unsafe_local=True)
    isolation = {
        "isolated": tools.sandbox_isolation(),
        "unsafe_local": tools_unsafe.sandbox_isolation(),
    }
    for name, fn in modes.items():  # warm-up, and every mode must work
        out = fn()
        if out != "42":
            raise SystemExit(f"{name}: expected '42', got {out!r}")
    times = {name: [] for name in modes}
    for _ in range(args.n):
        for name, fn in modes.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(1000 * (time.perf_counter() - t0))
    result = {
        "what": "wall-clock ms per python-tool call of print(6 * 7), modes interleaved call by call",
        "n_per_mode": args.n,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_avg_at_end": os.getloadavg(),
            "python": platform.python_version(),
            "euid": os.geteuid(),
        },
        "isolation": isolation,
        "modes": {
            name: {
                "median_ms": round(statistics.median(ts), 2),
                "p90_ms": round(_percentile(ts, 0.9), 2),
                "mean_ms": round(statistics.fmean(ts), 2),
            }
            for name, ts in times.items()
        },
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["modes"]))


if __name__ == "__main__":
    main()

"""The side-by-side benchmarks run: every module of bench/ imports, and every row of
`bench/run.py` runs once at its smallest size (`--smoke`: 1 measured repetition after 1 warm-up,
a few tokens, the tiny model for every scale) on rlhflab's side and, where TRL is installed (the
`bench` extra), on TRL's. The numbers are not results; the test shows the rows still run against
the current trainers (they drive the trainers through `rlhflab.trainers.loop.Run`).

CI runs this file again with the `bench` extra and RLHFLAB_REQUIRE_TRL=1, where a missing TRL
fails instead of skipping."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAVE_TRL = importlib.util.find_spec("trl") is not None
# Rows whose "theirs" side is TRL; the others compare with transformers' `generate` (generation)
# or a naive log-softmax (memory), which run everywhere.
TRL_ROWS = ("grpo_", "dpo_", "rm_", "sft_", "learning")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLHFLAB_")}
    env.update(
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
        OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), **extra,
    )  # fmt: skip
    return env


@pytest.mark.slow
def test_every_bench_module_imports():
    """Each bench/*.py imports (a fresh process: the modules set environment defaults)."""
    names = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, json, sys\n"
        "bad = {}\n"
        f"for n in {names!r}:\n"
        "    try:\n"
        "        importlib.import_module('bench.' + n)\n"
        "    except Exception as e:\n"
        "        bad[n] = f'{type(e).__name__}: {e}'\n"
        "print(json.dumps(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}
    assert "run" in names and "steps" in names and "ours" in names


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """`python bench/run.py --smoke` (every row), once; its results_full.json rows."""
    out_dir = tmp_path_factory.mktemp("bench_smoke")
    cache = tmp_path_factory.mktemp("bench_cache")
    out = subprocess.run(
        [sys.executable, "bench/run.py", "--smoke", "--out", str(out_dir)],
        cwd=ROOT, env=_env(RLHFLAB_BENCH_CACHE=str(cache)), capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
    assert not (ROOT / "bench" / "RESULTS.md").read_text().count("--smoke")  # not written there
    return json.loads((out_dir / "results_full.json").read_text())["results"]


def _rows():
    sys.path.insert(0, str(ROOT))
    from bench.run import BENCHMARKS

    return BENCHMARKS


@pytest.mark.slow
def test_every_row_runs_rlhflab_side(smoke):
    assert set(smoke) == set(_rows())
    for name, row in smoke.items():
        assert row["ours"]["n"] >= 1 and all(math.isfinite(v) for v in row["ours"]["values"]), name
        if not name.startswith(TRL_ROWS):
            assert all(math.isfinite(v) for v in row["theirs"]["values"]), name


@pytest.mark.slow
def test_every_row_runs_trl_side(smoke):
    if not HAVE_TRL:
        if os.environ.get("RLHFLAB_REQUIRE_TRL"):  # CI's bench step: never skip silently
            pytest.fail("RLHFLAB_REQUIRE_TRL is set but trl is not installed")
        pytest.skip("trl is not installed (the `bench` extra): TRL's side of the rows not run")
    trl_rows = [n for n in smoke if n.startswith(TRL_ROWS)]
    assert len(trl_rows) >= 9
    for name in trl_rows:
        values = smoke[name]["theirs"]["values"]
        assert values and all(math.isfinite(v) for v in values), name

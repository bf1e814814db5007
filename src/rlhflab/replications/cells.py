"""A replication as independent cells: run all, a share (`--only i/N`), or only the report.

A replication module that splits into cells (seeds, arms, β values) defines

    cells(spec: dict, source: str) -> list[str]          # cell ids, in order, e.g. "seed0-grpo"
    run_cell(spec, cell: str, out: Path, source) -> dict  # one cell's JSON-able results
    report(spec, cells: dict[str, dict], out, source) -> dict
        # every cell's results in -> the replication's results, with "verdict" (verdict.judge)
        # and "report" (the markdown of report.md)

and optionally `prepare(spec, out, source) -> None`, work every cell needs (a base model, a data
file) that must leave the same files whichever share runs it; it runs once per output directory,
under a file lock, before the first cell of any share.

`run_cells` writes, under `out`:
    spec.json            the resolved config; a later call with another config is refused
    cells/<cell>.json    each cell's results, written atomically when the cell ends (a finished
                         cell is never run again: a re-run continues where one stopped)
    verdict.json         the pre-registered criterion judged (verdict.write_verdict)
    report.md            question, setting, plots, estimates with CIs, verdict, what did not hold
    <module>.json        every number (the results `report` returned, with per-cell wall-clock)

`jobs` > 1 (`--jobs`) runs that many cells at a time, each in a process of its own (spawned; a
cell's results do not depend on which process or in what order it runs: each is seeded by its own
config and sets its own torch threads), a new cell starting as one ends; the results written are
those of a one-at-a-time run. `--jobs auto` (the command's default) is the number of CPU cores this
process may use divided by `experiment.threads`, on a machine without a GPU and with
`experiment.threads` set; else 1.

`--only i/N` runs cells j with j mod N = i (0 ≤ i < N) and writes no report, so N GPUs or machines
each run a share into the same directory (or into copies merged afterwards); `--report` trains
nothing and gathers the finished cells (refused, naming them, while any is missing).
"""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from rlhflab.errors import ConfigError
from rlhflab.serialize import write_json_atomic, write_text_atomic


def is_cellular(module: ModuleType) -> bool:
    """Whether `module` follows the cell protocol (module doc)."""
    return all(callable(getattr(module, f, None)) for f in ("cells", "run_cell", "report"))


def _check_spec(out: Path, spec: dict, name: str) -> None:
    path = out / "spec.json"
    canonical = json.loads(json.dumps(spec, default=str))
    if path.is_file():
        old = json.loads(path.read_text())
        if old != canonical:
            diff = _first_difference(old, canonical)
            raise ConfigError(
                f"replicate {name}: {out} holds cells of another config ({diff} differs); "
                "use another --out, or the same config and overrides"
            )
        return
    write_json_atomic(path, canonical)


def _first_difference(a, b, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
    return prefix.rstrip(".") or "the config"


def _cell_file(out: Path, cell: str) -> Path:
    return out / "cells" / f"{cell}.json"


def _prepare(module: ModuleType, spec: dict, out: Path, source: str, print_fn) -> None:
    if not callable(getattr(module, "prepare", None)):
        return
    done = out / "prepare.done"
    with open(out / ".prepare.lock", "w") as fd:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a second share waits here for the first's preparation
        if done.is_file():
            return
        t0 = time.perf_counter()
        print_fn("replicate: preparing what every cell shares")
        module.prepare(spec, out, source)
        write_text_atomic(done, f"{time.perf_counter() - t0:.1f}\n")


def auto_jobs(spec: dict) -> int:
    """`--jobs auto`: the CPU cores this process may use (`os.sched_getaffinity`) // the
    replication's `experiment.threads`, at least 1; 1 when `experiment.threads` is unset (torch
    then uses every core for one cell) or a GPU is visible (cells would share it)."""
    import os

    threads = (spec.get("experiment") or {}).get("threads")
    if not threads:
        return 1
    import torch

    if torch.cuda.is_available():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // int(threads))


def _run_one(module_name: str, name: str, spec: dict, cell: str, out: str, source: str) -> dict:
    """A cell in a worker process: `module.run_cell` with its training runs announced on stderr
    (prefixed with the cell) and transformers as quiet as in the command's own process, timed."""
    import importlib

    from rlhflab.quiet import quiet_transformers
    from rlhflab.tracking import announce_runs

    module = importlib.import_module(module_name)
    with quiet_transformers(), announce_runs(f"replicate {name} [{cell}]"):
        return _timed_cell(module, spec, cell, Path(out), source)


def _timed_cell(module: ModuleType, spec: dict, cell: str, out: Path, source: str) -> dict:
    """`module.run_cell`'s results with its wall-clock, `wall_s`."""
    c0 = time.perf_counter()
    result = module.run_cell(spec, cell, out, source)
    return {**result, "wall_s": round(time.perf_counter() - c0, 1)}


def _run_parallel(name, module, spec, out, source, todo, jobs, t0, print_fn) -> list[str]:
    """`todo`'s cells, `jobs` at a time in spawned processes; each cell's file written as it
    ends. A failed cell stops the rest (the ones running finish; none not yet started starts) and
    its error is raised here; the finished cells' files stay."""
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    ran: list[str] = []
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = {}
        for cell in todo:
            fut = pool.submit(_run_one, module.__name__, name, spec, cell, str(out), source)
            futures[fut] = cell
        print_fn(f"replicate {name}: {len(todo)} cell(s), {jobs} at a time "
                 f"({time.perf_counter() - t0:.0f} s elapsed)")  # fmt: skip
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                cell = futures[fut]
                err = fut.exception()
                if err is not None:
                    for other in pending:
                        other.cancel()
                    if isinstance(err, BrokenProcessPool):
                        raise RuntimeError(
                            f"replicate {name}: the process running cell '{cell}' died before it "
                            "ended (killed, out of memory, or a script that starts processes "
                            "without `if __name__ == '__main__':`); finished cells are kept: rerun "
                            "the same command, or with --jobs 1 to see the cell fail in this process"
                        ) from None
                    raise err
                result = fut.result()
                write_json_atomic(_cell_file(out, cell), result)
                ran.append(cell)
                print_fn(f"replicate {name}: cell '{cell}' done in {result['wall_s']:.0f} s "
                         f"({len(ran)}/{len(todo)}, {time.perf_counter() - t0:.0f} s elapsed)")  # fmt: skip
    return ran


def run_cells(
    name: str,
    module: ModuleType,
    spec: dict,
    out: Path,
    source: str,
    *,
    only: str | None = None,
    report_only: bool = False,
    jobs: int = 1,
    print_fn: Callable[[str], None] = print,
) -> dict:
    """Run a cell-protocol replication (module doc) into `out`, `jobs` cells at a time.

    Returns:
        the report's results (with "verdict", "report", "cells_wall_s", "wall_s", "files"), or
        for a share {"share", "ran", "skipped", "cells"}.

    Raises:
        ConfigError: a bad `--only`, `--only` with `--report`, `jobs` < 1, another config's
            cells in `out`, or `--report` while cells are missing (named).
    """
    if jobs < 1:
        raise ConfigError(f"replicate {name} --jobs {jobs}: must be at least 1 (or auto)")
    from rlhflab.replications.verdict import write_verdict
    from rlhflab.sweep import parse_only

    share = parse_only(only, command=f"replicate {name}")
    if share is not None and report_only:
        raise ConfigError(f"replicate {name}: --only and --report exclude each other")
    ids = module.cells(spec, source)
    if len(set(ids)) != len(ids) or not ids:
        raise ValueError(f"{name}: cells() must return distinct ids (got {ids})")
    (out / "cells").mkdir(parents=True, exist_ok=True)
    _check_spec(out, spec, name)
    t0 = time.perf_counter()
    ran, skipped = [], []
    if not report_only:
        mine = [c for j, c in enumerate(ids) if share is None or j % share[1] == share[0]]
        todo = [c for c in mine if not _cell_file(out, c).is_file()]
        skipped = [c for c in mine if c not in todo]
        if skipped:
            print_fn(f"replicate {name}: {len(skipped)} cell(s) already finished, kept")
        if todo:
            _prepare(module, spec, out, source, print_fn)
        if min(jobs, len(todo)) > 1:
            ran = _run_parallel(name, module, spec, out, source, todo, min(jobs, len(todo)), t0,
                                print_fn)  # fmt: skip
        else:
            for k, cell in enumerate(todo, 1):
                print_fn(f"replicate {name}: cell {k}/{len(todo)} '{cell}' started "
                         f"({time.perf_counter() - t0:.0f} s elapsed)")  # fmt: skip
                result = _timed_cell(module, spec, cell, out, source)
                write_json_atomic(_cell_file(out, cell), result)
                ran.append(cell)
                print_fn(f"replicate {name}: cell '{cell}' done in {result['wall_s']:.0f} s")
    if share is not None:
        print_fn(f"replicate {name}: share {only} done; gather with the same command and --report")
        return {"share": only, "ran": ran, "skipped": skipped, "cells": ids,
                "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    missing = [c for c in ids if not _cell_file(out, c).is_file()]
    if missing:
        raise ConfigError(
            f"replicate {name} --report: {len(missing)} of {len(ids)} cells not finished in {out} "
            f"({', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''}); run their shares"
        )
    results_by_cell = {c: json.loads(_cell_file(out, c).read_text()) for c in ids}
    results = module.report(spec, results_by_cell, out, source)
    if "verdict" not in results or "report" not in results:
        raise ValueError(f"{name}: report() must return 'verdict' and 'report'")
    prep = out / "prepare.done"
    prep_s = float(prep.read_text()) if prep.is_file() else 0.0
    results["cells_wall_s"] = {c: r["wall_s"] for c, r in results_by_cell.items()}
    # the preparation and every cell's own wall-clock, summed (with --jobs > 1 more than the
    # command's wall-clock; a cell waiting on another's shared work counts its wait)
    results["compute_s"] = round(prep_s + sum(results["cells_wall_s"].values()), 1)
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    verdict_path = write_verdict(out, results["verdict"])
    report_path = out / "report.md"
    write_text_atomic(report_path, results["report"])
    results_path = out / f"{module.__name__.rsplit('.', 1)[-1]}.json"
    results["files"] = [str(verdict_path), str(report_path), str(results_path)]
    write_json_atomic(results_path, results)
    return results

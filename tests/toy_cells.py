"""A toy replication in the cell protocol (rlhflab.replications.cells), importable by name so
that `run_cells(jobs=N)`'s spawned workers can run its cells: cell "seed<i>" gives i², the worker's
pid; with `experiment.fail` naming it, a one-line ConfigError; with `experiment.die`, its
process exits at once."""

import os
import time

from rlhflab.errors import ConfigError
from rlhflab.replications.verdict import Check, Criterion, judge


def cells(spec, source):
    return [f"seed{i}" for i in range(spec["experiment"]["n"])]


def prepare(spec, out, source):
    (out / "shared.txt").write_text("base")


def run_cell(spec, cell, out, source):
    if cell == spec["experiment"].get("fail"):
        raise ConfigError(f"toy: cell {cell} failed")
    if cell == spec["experiment"].get("die"):
        os._exit(3)
    assert (out / "shared.txt").read_text() == "base"
    sleep_s = spec["experiment"].get("sleep_s", 0.0)  # seconds, or {cell: seconds}
    time.sleep(sleep_s.get(cell, 0.0) if isinstance(sleep_s, dict) else sleep_s)
    return {"value": int(cell[4:]) ** 2, "pid": os.getpid()}


def report(spec, cells, out, source):
    values = [cells[c]["value"] for c in sorted(cells)]
    crit = Criterion("sum is positive", (Check("total", "sum of values", above=0),))
    verdict = judge("toy", crit, {"total": (sum(values), sum(values), sum(values))}, [0])
    return {"values": values, "verdict": verdict, "report": f"# toy\n{values}\n"}

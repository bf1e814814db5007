"""Fault injection points ("failpoints") for the reliability tests. Inert unless the environment
variable `RLHFLAB_FAULT` is set.

`RLHFLAB_FAULT` holds comma-separated rules `<point>@<n>=<action>`:

    step_end@5=sigkill        the process kills itself with SIGKILL at the end of step 5
                              (after that step's checkpoint, if one was due)
    step_mid@3=sigterm        SIGTERM to itself in the middle of step 3 (after the backward pass)
    checkpoint_file@2=sigkill SIGKILL while writing a checkpoint, right after its 2nd file
    loss@4=nan                the loss of step 4 becomes NaN (also: inf)
    checkpoint_file@8=enospc  the 8th checkpoint file written fails with "No space left on device"

Points and counters are chosen by the trainers (`step_*`, `loss`: the optimizer step number;
`checkpoint_file`: files written by this process since start). Actions: sigkill, sigterm, sigint,
nan, inf, enospc. The tests use these to kill a run at a chosen step, crash a writer after i files and
inject a non-finite loss, so that every fault scenario is reproducible to the step.
"""

from __future__ import annotations

import errno
import functools
import os
import signal

import torch

FAULT_ENV = "RLHFLAB_FAULT"
_SIGNALS = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigint": signal.SIGINT}
_VALUES = {"nan": float("nan"), "inf": float("inf")}


@functools.lru_cache(maxsize=8)
def _parse(spec: str) -> dict[tuple[str, int], str]:
    rules = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            where, action = part.split("=")
            point, n = where.split("@")
            rules[(point, int(n))] = action
        except ValueError:
            raise ValueError(f"{FAULT_ENV}: cannot parse rule {part!r}") from None
        if action not in _SIGNALS and action not in _VALUES and action != "enospc":
            raise ValueError(f"{FAULT_ENV}: unknown action {action!r} in {part!r}")
    return rules


def _action(point: str, n: int) -> str | None:
    spec = os.environ.get(FAULT_ENV)
    return _parse(spec).get((point, n)) if spec else None


def hit(point: str, n: int) -> None:
    """Send the configured signal to this process if a rule names (point, n); for "enospc"
    raise the OSError of a full disk."""
    action = _action(point, n)
    if action in _SIGNALS:
        os.kill(os.getpid(), _SIGNALS[action])
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def corrupt(point: str, n: int, value: torch.Tensor) -> torch.Tensor:
    """`value` with NaN/inf added if a rule names (point, n); `value` itself otherwise."""
    action = _action(point, n)
    if action in _VALUES:
        return value + _VALUES[action]
    return value

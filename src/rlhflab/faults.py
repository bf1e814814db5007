"""Fault injection points ("failpoints") for the reliability tests. Inert unless the environment
variable `RLHFLAB_FAULT` is set.

`RLHFLAB_FAULT` holds comma-separated rules `<point>@<n>=<action>`:

    step_end@5=sigkill        the process kills itself with SIGKILL at the end of step 5
                              (after that step's checkpoint, if one was due)
    step_mid@3=sigterm        SIGTERM to itself in the middle of step 3 (after the backward pass)
    step_end@1=sigstop        the process stops itself (SIGSTOP) at the end of step 1, holding
                              its locks, until the test continues or kills it
    checkpoint_file@2=sigkill SIGKILL while writing a checkpoint, right after its 2nd file
    loss@4=nan                the loss of step 4 becomes NaN (also: inf)
    checkpoint_file@8=enospc  the 8th checkpoint file written fails with "No space left on device"
    eval@4=expire             `train.max_seconds` runs out during the held-out evaluation at
                              step 4 (`rlhflab.trainers.loop.TimeBudget`; no sleeping)

A rule prefixed with `rank<r>:` (e.g. `rank1:step_mid@3=sigkill`) fires only in the
data-parallel process of that rank (torchrun's RANK); unprefixed rules fire in every process.

`RLHFLAB_GRAD_DUMP=<dir>` (exactness tests of data parallelism): at every optimizer step, the full
gradients after the sum over ranks and before clipping are written by rank 0 to
`<dir>/grads-<k>.safetensors` (k counts optimizer steps of the process from 1).

Points and counters are chosen by the trainers (`step_*`, `loss`, `eval`: the optimizer step
number; `checkpoint_file`: files written by this process since start). Actions: sigkill, sigterm,
sigint, sigstop, nan, inf, enospc, expire. The tests use these to kill a run at a chosen step, crash a writer after i files and
inject a non-finite loss, so that every fault scenario is reproducible to the step.
"""

from __future__ import annotations

import errno
import functools
import os
import signal

import torch

FAULT_ENV = "RLHFLAB_FAULT"
_SIGNALS = {
    "sigkill": signal.SIGKILL,
    "sigterm": signal.SIGTERM,
    "sigint": signal.SIGINT,
    "sigstop": signal.SIGSTOP,
}
_VALUES = {"nan": float("nan"), "inf": float("inf")}


@functools.lru_cache(maxsize=8)
def _parse(spec: str) -> dict[tuple[str, int], str]:
    rules = {}
    rank = os.environ.get("RANK", "0")
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if part.startswith("rank"):
            who, _, part = part.partition(":")
            if who != f"rank{rank}":
                continue
        try:
            where, action = part.split("=")
            point, n = where.split("@")
            rules[(point, int(n))] = action
        except ValueError:
            raise ValueError(f"{FAULT_ENV}: cannot parse rule {part!r}") from None
        if action not in _SIGNALS and action not in _VALUES and action not in ("enospc", "expire"):
            raise ValueError(f"{FAULT_ENV}: unknown action {action!r} in {part!r}")
    return rules


def _action(point: str, n: int) -> str | None:
    spec = os.environ.get(FAULT_ENV)
    return _parse(spec).get((point, n)) if spec else None


_EXPIRED = {"now": False}


def hit(point: str, n: int) -> None:
    """Send the configured signal to this process if a rule names (point, n); for "enospc"
    raise the OSError of a full disk; for "expire" make the time budget run out (`expired`)."""
    action = _action(point, n)
    if action in _SIGNALS:
        os.kill(os.getpid(), _SIGNALS[action])
    elif action == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    elif action == "expire":
        _EXPIRED["now"] = True


def expired() -> bool:
    """Whether an "expire" rule has fired in this process (the time budget is then spent)."""
    return _EXPIRED["now"]


def clear_expired() -> None:
    """Forget a fired "expire" rule (a new run's budget starts unspent)."""
    _EXPIRED["now"] = False


def corrupt(point: str, n: int, value: torch.Tensor) -> torch.Tensor:
    """`value` with NaN/inf added if a rule names (point, n); `value` itself otherwise."""
    action = _action(point, n)
    if action in _VALUES:
        return value + _VALUES[action]
    return value


_DUMPS = {"n": 0}


def dump_grads(model: torch.nn.Module) -> None:
    """Write the model's full gradients when `RLHFLAB_GRAD_DUMP` is set (see the module doc)."""
    where = os.environ.get("RLHFLAB_GRAD_DUMP")
    if not where:
        return
    from pathlib import Path

    from safetensors.torch import save_file

    from rlhflab import distributed

    grads = distributed.full_grads(model)
    _DUMPS["n"] += 1
    if distributed.is_main():
        Path(where).mkdir(parents=True, exist_ok=True)
        save_file(grads, str(Path(where) / f"grads-{_DUMPS['n']}.safetensors"))

"""The launcher of `rlhflab train --nproc N`: torchrun (`torch.distributed.run`, the same arguments)
with rlhflab's exit codes and no launcher traceback.

torchrun reports any failed worker by raising `ChildFailedError` in the launcher, a 40-line
traceback and exit code 1, even when the worker refused a user error in one line and exit code 2
(`rlhflab.cli`). This module runs torchrun's own `run(args)` and reads the failures from the
exception's `failures` (`{rank: ProcessFailure}`, torch's elastic API) instead:

- a worker that exited with a code of its own (2 a user error, 3 a health stop, 130/143 a stop
  signal) has already printed its line: the launcher exits with that code and prints nothing;
- a worker that crashed (exit code 1: it printed its traceback) or was killed by a signal: one line
  naming the rank and the code or signal; exit code 1, or 128 + the signal number;
- the launcher itself stopped by SIGINT / SIGTERM (torchrun's `SignalException`): its workers
  were stopped and say what they saved; exit code 128 + the signal number.

The agent's own log lines about the failure ("failed (exitcode: 2) local_rank: 0 ...",
"Sending process ... closing signal SIGTERM") are silenced: the line above says it once.

Run as `python -m rlhflab.distributed.launch --standalone --nproc-per-node=N -m rlhflab ...`.
"""

from __future__ import annotations

import logging
import signal
import sys

#: Exit codes with which an rlhflab worker stops after printing why (rlhflab.cli, rlhflab.errors):
#: a user error (2), a health stop (3), SIGINT / SIGTERM after a checkpoint (130 / 143).
OWN_EXIT_CODES = (2, 3, 130, 143)

# The loggers of torch's elastic agent that re-say a worker's failure (worker exit codes, the
# SIGTERM sent to the other workers, the agent's own stop signal).
_QUIET_LOGGERS = {
    "torch.distributed.elastic.multiprocessing.api": logging.CRITICAL,
    "torch.distributed.elastic.agent.server.api": logging.ERROR,
}


def exit_status(failures: dict[int, tuple[int, float]]) -> tuple[int, str | None]:
    """The exit code of `rlhflab train --nproc` and the line to print (None: the worker printed it).

    Args:
        failures: `{global rank: (exit code, timestamp in seconds)}` of the failed workers, as in
            torch's `ChildFailedError.failures` (`ProcessFailure.exitcode`, `.timestamp`); a
            negative exit code is the signal that ended the worker.

    The root cause is the worker that exited by itself (code > 0) first (ties: the lowest rank):
    the others were usually stopped by torchrun because of it (SIGTERM, code -15). With no such
    worker, the first worker ended by a signal.

    Returns:
        (code, line): code 2/3/130/143 with line None (the worker printed its one line); code 1
        (or the worker's other code) for a crash, 128 + N for a worker killed by signal N, each
        with a one-line `error: ...` naming the rank.
    """
    if not failures:
        return 0, None
    own = {r: v for r, v in failures.items() if v[0] > 0}
    pool = own or failures
    rank = min(pool, key=lambda r: (pool[r][1], r))
    code = pool[rank][0]
    if code in OWN_EXIT_CODES:
        return code, None
    if code > 0:
        return code, f"error: rank {rank} failed with exit code {code} (its output is above)"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return 128 - code, f"error: rank {rank} was killed by {name}"


def main(argv: list[str] | None = None) -> int:
    """torchrun's `main` with `exit_status`'s exit code and line in place of its traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    for name, level in _QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    try:
        run(args)
    except ChildFailedError as exc:
        code, line = exit_status({r: (f.exitcode, f.timestamp) for r, f in exc.failures.items()})
        if line is not None:
            print(line, file=sys.stderr)
        return code
    except SignalException as exc:  # SIGINT / SIGTERM to the launcher: its workers were stopped
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())

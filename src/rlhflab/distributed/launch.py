"""The launcher of `rlhflab train --nproc N`: torchrun (`torch.distributed.run`, the same arguments)
with rlhflab's exit codes and no launcher traceback.

torchrun reports any failed worker by raising `ChildFailedError` in the launcher, a 40-line
traceback and exit code 1, even when the worker refused a user error in one line and exit code 2
(`rlhflab.cli`). This module runs torchrun's own `run(args)` and reads the failures from the
exception's `failures` (`{rank: ProcessFailure}`, torch's elastic API) instead:

- a worker that exited with a code of its own (2 a user error, 3 a health stop, 130/143 a stop
  signal): the launcher exits with that code, printing the user error's line the worker
  recorded (below), once; nothing when the worker printed its own lines;
- a worker that crashed (exit code 1: it printed its traceback) or was killed by a signal: one line
  naming the rank and the code or signal; exit code 1, or 128 + the signal number;
- the launcher itself stopped by SIGINT / SIGTERM (torchrun's `SignalException`): its workers
  were stopped and say what they saved; exit code 128 + the signal number.

A worker's user error reaches the launcher through torch's own channel for a worker's root
cause, the error file torchrun names in `TORCHELASTIC_ERROR_FILE` (`record_error`; the file
`torch.distributed.elastic.multiprocessing.errors.record` writes for an uncaught exception): under
this launcher (`RLHFLAB_NPROC_LAUNCHER=1`, set by `rlhflab train --nproc`) the ranks write their
one line there instead of printing it, and the launcher prints the root cause's line once (two
ranks stopped by the same NaN loss printed it twice). Under a bare torchrun the ranks print it and
write it, so torchrun's report names it as the root cause.

The agent's own log lines about the failure ("failed (exitcode: 2) local_rank: 0 ...",
"Sending process ... closing signal SIGTERM") are silenced: the line above says it once.

Run as `python -m rlhflab.distributed.launch --standalone --nproc-per-node=N -m rlhflab ...`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

#: Exit codes with which an rlhflab worker stops after printing why (rlhflab.cli, rlhflab.errors):
#: a user error (2), a health stop (3), SIGINT / SIGTERM after a checkpoint (130 / 143).
OWN_EXIT_CODES = (2, 3, 130, 143)

# The loggers of torch's elastic agent that re-say a worker's failure (worker exit codes, the
# SIGTERM sent to the other workers, the agent's own stop signal).
_QUIET_LOGGERS = {
    "torch.distributed.elastic.multiprocessing.api": logging.CRITICAL,
    "torch.distributed.elastic.agent.server.api": logging.ERROR,
}


#: The key of the error file's `extraInfo` that holds a worker's one-line user error.
LINE_KEY = "rlhflab_line"


def record_error(line: str) -> bool:
    """Write this worker's one-line user error to the error file torchrun gave it
    (`TORCHELASTIC_ERROR_FILE`), in the layout of torch's `ErrorHandler.record_exception`
    (`{"message": {"message", "extraInfo": {"py_callstack", "timestamp"}}}`, which torchrun's
    report prints) plus `extraInfo[LINE_KEY]`. Returns False (nothing written) without that
    variable or when the file cannot be written."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    info = {"py_callstack": line, "timestamp": str(int(time.time())), LINE_KEY: line}
    try:
        from rlhflab.serialize import to_json  # the one JSON writer (secrets redacted)

        with open(path, "w") as f:
            f.write(to_json({"message": {"message": line, "extraInfo": info}}))
    except OSError:
        return False
    return True


def recorded_line(error_file_data: object) -> str | None:
    """The line `record_error` wrote, from a failure's error file data
    (`ProcessFailure.error_file_data`); None for any other content."""
    try:
        line = error_file_data["message"]["extraInfo"][LINE_KEY]  # type: ignore[index]
    except (KeyError, TypeError):
        return None
    return line if isinstance(line, str) else None


def exit_status(failures: dict[int, tuple]) -> tuple[int, str | None]:
    """The exit code of `rlhflab train --nproc` and the line to print (None: nothing to add).

    Args:
        failures: `{global rank: (exit code, timestamp in seconds[, recorded line])}` of the
            failed workers, as in torch's `ChildFailedError.failures` (`ProcessFailure.exitcode`,
            `.timestamp`, the `record_error` line of its error file or None); a negative exit
            code is the signal that ended the worker.

    The root cause is the worker that exited by itself (code > 0) first (ties: the lowest rank):
    the others were usually stopped by torchrun because of it (SIGTERM, code -15). With no such
    worker, the first worker ended by a signal other than SIGTERM (ties: the lowest rank), else
    the first one ended by SIGTERM.

    Returns:
        (code, line): code 2/3/130/143 with the recorded line of the root cause (or, when it
        recorded none, the first recorded line of a worker that exited with the same code, else
        of any worker, e.g. rank 0 stopped by torchrun after recording it), None when no worker
        recorded one (it printed its own);
        code 1 (or the worker's other code) for a crash, 128 + N for a worker killed by signal N,
        each with a one-line `error: ...` naming the rank.
    """
    if not failures:
        return 0, None
    own = {r: v for r, v in failures.items() if v[0] > 0}
    # torchrun stops the other workers with SIGTERM once one has died, often within the same
    # poll (equal timestamps): a worker killed by another signal is the root cause
    killed = {r: v for r, v in failures.items() if v[0] != -int(signal.SIGTERM)}
    pool = own or killed or failures
    order = sorted(pool, key=lambda r: (pool[r][1], r))
    rank = order[0]
    code = pool[rank][0]
    if code in OWN_EXIT_CODES:
        lines = [pool[r][2] for r in order if pool[r][0] == code and len(pool[r]) > 2]
        # then any worker's: rank 0 may have recorded it and been stopped by torchrun (SIGTERM)
        # before it exited by itself
        everyone = sorted(failures, key=lambda r: (failures[r][1], r))
        lines += [failures[r][2] for r in everyone if len(failures[r]) > 2]
        return code, next((x for x in lines if x), None)
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
        code, line = exit_status(
            {
                r: (f.exitcode, f.timestamp, recorded_line(f.error_file_data))
                for r, f in exc.failures.items()
            }
        )
        if line is not None:
            print(line, file=sys.stderr)
        return code
    except SignalException as exc:  # SIGINT / SIGTERM to the launcher: its workers were stopped
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`rlhflab train --nproc`'s exit code and line from torchrun's failures
(`rlhflab.distributed.launch.exit_status`): the worker's own exit code when it stopped by itself
(its line already printed), one line naming the rank for a crash or a signal."""

from __future__ import annotations

import pytest

from rlhflab.distributed.launch import exit_status


@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        ({}, (0, None)),
        # rank 0 refused a user error; torchrun then stopped rank 1 (SIGTERM = -15)
        ({0: (2, 10.0), 1: (-15, 10.0)}, (2, None)),
        # a rank that exited by itself is the root cause even if a signal was seen first
        ({0: (-15, 5.0), 1: (2, 10.0)}, (2, None)),
        ({0: (143, 7.0), 1: (-15, 7.0)}, (143, None)),  # stopped by SIGTERM after a checkpoint
        ({0: (3, 7.0)}, (3, None)),  # a health stop
        # same second: the lowest rank
        ({1: (1, 5.0), 0: (2, 5.0)}, (2, None)),
        ({1: (1, 5.0), 0: (2, 6.0)}, (1, "error: rank 1 failed with exit code 1 (its output is above)")),
        ({1: (-9, 3.0), 0: (-15, 4.0)}, (137, "error: rank 1 was killed by SIGKILL")),
    ],
)  # fmt: skip
def test_exit_status(failures, expected):
    assert exit_status(failures) == expected

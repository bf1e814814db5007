"""SIGTERM / SIGINT during training: finish the step, checkpoint, then stop."""

from __future__ import annotations

import signal


class StopSignals:
    """Context manager: SIGTERM and SIGINT set `requested` (the signal number) instead of killing
    the process, so the trainer can finish the current step and write a checkpoint. A second
    signal while the first is handled raises KeyboardInterrupt (abandon at once). Handlers are only
    installed in the main thread; the previous handlers are restored on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested: int | None = None
        self._previous: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signum

    def __enter__(self) -> StopSignals:
        import threading

        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

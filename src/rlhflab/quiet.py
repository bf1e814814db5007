"""Quiet transformers while rlhflab's own code runs: no weight-loading / shard-writing progress
bars and no info or warning log lines. Everything is restored on exit, so a user's own
transformers calls are left as they were.

    with quiet_transformers():
        results = run_config(cfg)

What is silenced, and why the user cannot act on it:
* transformers' tqdm bars ("Loading weights", "Writing model shards"): one per model load or save,
  interleaved with rlhflab's own progress display;
* transformers' log lines below ERROR (e.g. newly initialised reward heads, which rlhflab
  initialises on purpose), and torchao's and torch pytree's (`QUIET_LOGGERS`).

Warnings are not filtered: a FutureWarning / DeprecationWarning about how rlhflab calls
transformers is a bug to fix where the call is made (rlhflab.rollout.sampler passes the KV cache
under the name the installed transformers takes, `cache_kwarg`), not to hide.
"""

from __future__ import annotations

import contextlib
import logging
import warnings


@contextlib.contextmanager
def quiet_transformers():
    """Context manager: transformers' progress bars off and its logging at ERROR for the
    duration; the previous settings (verbosity, progress bars) are restored on exit. Nested use is
    fine. It does not import transformers (seconds, with torch): when transformers is not
    imported yet, the settings are applied right after its first import
    (`rlhflab._autoregister.when_imported`), so a command that fails before loading a model
    stays fast."""
    from rlhflab import _autoregister

    saved: dict = {}

    def apply() -> None:
        from transformers.utils import logging as hf_logging

        saved.update(
            verbosity=hf_logging.get_verbosity(),
            bars=hf_logging.is_progress_bar_enabled(),
            hub_bars_off=_hub_bars_disabled(),
        )
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()

    token = _autoregister.when_imported(apply)
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        _autoregister.cancel(token)
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
        if saved:
            _restore(saved)


#: Loggers below ERROR are silenced too: torchao (imported by transformers whenever installed)
#: warns about its optional CUDA kernels that do not load on a CPU machine, and torch's pytree
#: notes that torchao registers enums the old way; neither is something a user can act on.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def _restore(saved: dict) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity(saved["verbosity"])
    if saved["bars"]:
        with warnings.catch_warnings():  # the hub warns when its env var disables bars
            warnings.simplefilter("ignore")
            hf_logging.enable_progress_bar()
        if saved["hub_bars_off"]:
            _disable_hub_bars()


def _hub_bars_disabled() -> bool:
    try:
        from huggingface_hub.utils import are_progress_bars_disabled
    except ImportError:  # pragma: no cover
        return False
    return bool(are_progress_bars_disabled())


def _disable_hub_bars() -> None:
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()

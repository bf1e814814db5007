"""Typed run configs (moved from rlhflab/config.py to rlhflab/config/sections.py; split by concern
in the next commit). Re-exports every name the module offered."""

from rlhflab.config.sections import *  # noqa: F403
from rlhflab.config.sections import (  # noqa: F401
    _check_clip_bounds,
    _check_kwargs,
    _check_micro,
    _check_name,
    _did_you_mean,
    _format_error,
    _section_class,
    _wants_number,
)

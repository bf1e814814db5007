"""Kept importable under its old name (moved to rlhflab.serialize)."""

from rlhflab.serialize import *  # noqa: F403
from rlhflab.serialize import decode_nonfinite, encode_nonfinite, redact_obj  # noqa: F401

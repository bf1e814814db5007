"""Moved to `rlhflab.models.packing` (packing is part of a model's forward, and `models/` sits below
`rollout/`); this module keeps the old import path working. Patch or extend the names there."""

from rlhflab.models.packing import (  # noqa: F401
    MIN_SAVING,
    PACKABLE,
    PackedLayout,
    can_pack,
    packed_completion_logits,
    packed_hidden,
    packed_layout,
)

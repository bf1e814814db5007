"""A fingerprint of the training data a run uses: how many rows and the sha256 of their content.

Recorded with the data position in every checkpoint (`ShuffledStream`), so that resuming on data
that changed since the checkpoint (rows added, removed or edited) is refused with one line
instead of indexing rows that are no longer there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any


def _plain(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.asdict(x)
    if hasattr(x, "tolist"):  # tensors, numpy arrays
        return x.tolist()
    return str(x)


def data_fingerprint(rows: list[Any]) -> dict:
    """`{"rows": len(rows), "sha256": hex digest}` of the rows (token-id lists, strings, tuples,
    dicts, dataclasses and tensors of those), order included."""
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, default=_plain).encode())
        h.update(b"\n")
    return {"rows": len(rows), "sha256": h.hexdigest()}

"""What every dataset loader does once its rows are parsed: report the rows dropped as invalid
(per reason) and refuse a dataset left empty."""

from __future__ import annotations

import logging

from rlhflab.errors import DataError

logger = logging.getLogger(__name__)


def finish_rows(rows: list, drops: dict[str, int], source: str, empty: str) -> list:
    """Return `rows` after logging one warning with the drop counts (`drops`: reason → count).

    Args:
        rows: the parsed rows kept.
        drops: invalid rows dropped, per reason (zero counts are left out of the message).
        source: the file or dataset, named in the warning.
        empty: the error message when no row is left (" (N invalid rows dropped)" is appended).

    Raises:
        DataError: `rows` is empty.
    """
    n_dropped = sum(drops.values())
    if n_dropped:
        detail = ", ".join(f"{k}={v}" for k, v in drops.items() if v)
        logger.warning("%s: dropped %d invalid rows (%s)", source, n_dropped, detail)
    if not rows:
        detail = f" ({n_dropped} invalid rows dropped)" if n_dropped else ""
        raise DataError(f"{empty}{detail}")
    return rows

"""The data position of every trainer: row indices forever, each pass in a fresh shuffled order
(SFT and RM examples, preference rows, policy-gradient and distillation prompts), carried through
checkpoints. Part of `rlhflab.experience` (re-exported by `rlhflab.trainers.common`)."""

from __future__ import annotations

import random
import warnings

from rlhflab.checkpoint import python_rng_state, set_python_rng_state
from rlhflab.errors import DataError

__all__ = ["ShuffledStream"]


class ShuffledStream:
    """Row indices forever, each pass over `n` rows in a fresh order drawn from `rng`: the data
    position of every trainer (SFT and RM examples, preference rows, policy-gradient prompts).

    `take(k)` returns the next k indices (a pass may end inside a batch; the next pass continues
    it). The position is `order` (indices left in this pass, popped from the end) plus the state
    of `rng`; `state()` / `load()` carry both through checkpoints. `rng` may be shared with other
    draws of the trainer (direct alignment samples its rounds' prompts from it too).
    """

    def __init__(
        self,
        n: int,
        rng: random.Random,
        *,
        fingerprint: dict | None = None,
        allow_change: bool = False,
    ) -> None:
        self.n, self.rng, self.order = n, rng, []
        # `rlhflab.fingerprint.data_fingerprint` of the rows: checked by `load` (data changed
        # since the checkpoint: an error, or with `allow_change` a new pass over the new rows).
        self.fingerprint, self.allow_change = fingerprint, allow_change

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if not self.order:
            self.order = list(range(self.n))
            self.rng.shuffle(self.order)
        return self.order.pop()

    def take(self, k: int) -> list[int]:
        """The next k row indices."""
        return [next(self) for _ in range(k)]

    def restart(self, n: int, fingerprint: dict | None = None) -> None:
        """Start a new pass over `n` rows at the next draw (new data, e.g. a DPO round)."""
        self.n, self.order, self.fingerprint = n, [], fingerprint

    def state(self) -> dict:
        """The position as JSON: rows, indices left in this pass, rng state, data fingerprint."""
        return {
            "n": self.n,
            "order": self.order,
            "rng": python_rng_state(self.rng),
            "fingerprint": self.fingerprint,
        }

    def load(self, state: dict) -> None:
        """Continue from a `state()`.

        Raises:
            DataError: the rows differ from the checkpoint's (count or content) and
                `allow_change` is off. With it, the stream starts a new pass over the new rows.
        """
        saved = state.get("fingerprint")
        set_python_rng_state(state["rng"], self.rng)
        if saved is not None and self.fingerprint is not None and saved != self.fingerprint:
            change = (
                f"training data changed since the checkpoint: {saved['rows']} rows "
                f"(sha256 {saved['sha256'][:12]}) then, {self.fingerprint['rows']} rows "
                f"(sha256 {self.fingerprint['sha256'][:12]}) now"
            )
            if not self.allow_change:
                raise DataError(
                    f"{change}; restore the data or pass --allow-config-change to continue on "
                    "the new data"
                )
            warnings.warn(f"{change}; continuing with a new pass over the new data", stacklevel=2)
            self.order = []  # a new pass over the new rows
            return
        self.n, self.order = state["n"], state["order"]

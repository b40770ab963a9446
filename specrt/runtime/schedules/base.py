"""What the loop asks a one-row draft-length schedule each round (`DraftSchedule`), and the
per-token callback a schedule may give the draft step (`KeepGoing`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

# keep_going(drafted so far, confidence of the last drafted token) -> draft another?
KeepGoing = Callable[[int, float], bool]


class DraftSchedule(Protocol):
    """What the loop asks each round."""

    # called after each drafted token, or None: the schedule needs no per-token say
    keep_drafting: KeepGoing | None

    def start_round(self, limit: int) -> int:
        """How many tokens to draft at most this round (``limit``: what fits)."""
        ...

    def update(
        self, drafted: int, accepted: int, draft_time_s: float, verify_time_s: float
    ) -> None:
        """Record a round: ``drafted`` proposed, ``accepted`` kept, and what each part took."""
        ...

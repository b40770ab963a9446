"""What the loop asks a one-row draft-length schedule each round (`DraftSchedule`), the
per-token callback a schedule may give the draft step (`KeepGoing`), and what a call costs in
positions (`computed_positions`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

# keep_going(drafted so far, confidence of the last drafted token) -> draft another?
KeepGoing = Callable[[int, float], bool]


def computed_positions(positions: int, even_rows: bool) -> int:
    """The positions a call over ``positions`` computes: one more where the target's calls
    compute an even number (``even_rows``) and the count is odd."""
    return positions + positions % 2 if even_rows else positions


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

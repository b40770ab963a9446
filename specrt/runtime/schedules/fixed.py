"""The schedules that decide K before a round, so need no per-token callback: a fixed K, and
the classic +2/-1 heuristic (for comparison with the adaptive one)."""

from __future__ import annotations

from specrt.runtime.schedules.constants import HEURISTIC_START


class FixedSchedule:
    """K tokens every round (fewer where they would not fit)."""

    keep_drafting = None

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max

    def start_round(self, limit: int) -> int:
        return min(limit, self.k_max)

    def update(
        self, drafted: int, accepted: int, draft_time_s: float, verify_time_s: float
    ) -> None:
        pass


class HeuristicSchedule:
    """The classic schedule, for comparison: K grows by 2 after a fully accepted round and
    shrinks by 1 otherwise (as transformers' ``num_assistant_tokens_schedule="heuristic"``).
    It decides K before the round, so it needs no per-token callback."""

    keep_drafting = None

    def __init__(self, k_max: int, start: int = HEURISTIC_START) -> None:
        self.k_max = k_max
        self.k = min(start, k_max)

    def start_round(self, limit: int) -> int:
        return min(limit, self.k)

    def update(
        self, drafted: int, accepted: int, draft_time_s: float, verify_time_s: float
    ) -> None:
        if drafted and accepted == drafted:
            self.k = min(self.k_max, self.k + 2)
        else:
            self.k = max(1, self.k - 1)

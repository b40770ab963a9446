"""Draft-length schedules: how many tokens to draft each round. For one row: fixed, adaptive or
the classic +2/-1 heuristic, which the loop asks the same questions (`DraftSchedule`); for rows
sharing calls, the load schedule.

``base`` holds the protocol, ``fixed`` the fixed and heuristic schedules, ``adaptive`` the
adaptive one, ``load`` the load schedule, ``estimators`` what they estimate with (line fit, round
times, check spacing), ``constants`` every tunable of these learners (and the hybrid proposer's),
with its unit.
"""

from __future__ import annotations

from specrt.runtime.schedules.adaptive import AdaptiveSchedule
from specrt.runtime.schedules.base import DraftSchedule, KeepGoing
from specrt.runtime.schedules.constants import LOAD_EXPLORE_SHARE
from specrt.runtime.schedules.estimators import LineFit, RoundTimes
from specrt.runtime.schedules.fixed import FixedSchedule, HeuristicSchedule
from specrt.runtime.schedules.load import LoadSchedule

__all__ = [
    "LOAD_EXPLORE_SHARE",
    "AdaptiveSchedule",
    "DraftSchedule",
    "FixedSchedule",
    "HeuristicSchedule",
    "KeepGoing",
    "LineFit",
    "LoadSchedule",
    "RoundTimes",
    "make_schedule",
]


def make_schedule(name: str, k_max: int, even_rows: bool = False) -> DraftSchedule:
    """The schedule ``name`` (one of `config.DRAFT_SCHEDULES`), drafting at most ``k_max``
    (``even_rows``: the target's calls compute an even number of positions)."""
    if name == "adaptive":
        return AdaptiveSchedule(k_max, even_rows=even_rows)
    return {"fixed": FixedSchedule, "heuristic": HeuristicSchedule}[name](k_max)

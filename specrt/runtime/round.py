"""One speculative round: draft K tokens, verify them in ONE target pass, accept a prefix.

The math of which tokens stand is in `verification.py`; rolling the caches back and stopping are
the caller's (`generator.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from specrt.backends import Decoder
from specrt.runtime.config import SamplingParams
from specrt.runtime.drafters import Drafter
from specrt.runtime.sampling import rows_needed
from specrt.runtime.schedules import KeepGoing
from specrt.runtime.verification import verify


@dataclass
class RoundResult:
    drafted: int  # draft tokens proposed
    accepted: int  # of them kept by the target
    tokens: list[int]  # emitted: the accepted draft tokens, then the recovered or bonus token
    draft_time_s: float
    verify_time_s: float


def speculative_round(
    target: Decoder,
    drafter: Drafter,
    tokens: list[int],
    k: int,
    sampling: SamplingParams,
    rng: np.random.Generator,
    keep_drafting: KeepGoing | None = None,
) -> RoundResult:
    """Continue ``tokens`` by one round: at most ``k`` draft tokens (``keep_drafting`` may stop
    the drafter earlier), all of them checked by one target pass. k = 0 is a plain target step.

    The target's cache holds all of ``tokens`` but the newest (the caller rolls it back so); it
    is fed that token and the draft, K+1 positions, and returns what verification reads of
    them (`sampling.rows_needed`)."""
    started = time.perf_counter()
    draft = drafter.propose(tokens, k, sampling, rng, keep_drafting)
    drafted_at = time.perf_counter()

    fed = tokens[target.length :] + draft.tokens
    out = target.forward(fed, keep_last=len(draft.tokens) + 1, need=rows_needed(sampling))
    accepted, next_token = verify(draft.tokens, draft.probabilities, out, sampling, rng)
    return RoundResult(
        drafted=len(draft.tokens),
        accepted=accepted,
        tokens=[*draft.tokens[:accepted], next_token],
        draft_time_s=drafted_at - started,
        verify_time_s=time.perf_counter() - drafted_at,
    )

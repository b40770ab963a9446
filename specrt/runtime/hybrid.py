r"""The hybrid drafter: each round, the continuation found by matching (prompt lookup, the suffix
cache) or the draft model's, whichever is expected to give more tokens per second.

A match proposes up to L tokens for free; the round then costs one verification pass of L+1
positions, :math:`T(L)`, a line fitted to the passes measured so far (on a CPU each position
adds a real share of a pass, docs/performance.md; on a GPU next to nothing). Its expected yield is
:math:`E(L) = 1 + \sum_{j \le L} \prod_{i \le j} a_i`, where :math:`a_i` is the learned rate at
which the token at position i of such a match is accepted when the ones before it were, kept per
proposer, match length, how the row's previous match fared (none kept, some, all, or none yet: a
row that is copying keeps copying) and whether the match continues the row's own output or its
prompt (decayed counts over a prior). The hybrid takes the L with the most :math:`E(L)/T(L)` and
uses it when that beats the rate of recent model rounds (the draft-length schedule's choices
included), which it measures as they run; otherwise the model drafts as it would alone. Both
rates are counted in tokens per one-position pass, :math:`T(0)` at the time, not per second: a
pass costs more as the row grows, and a rate learned on short rows must still compare right on
long ones. Timings are what the rounds took.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from specrt.runtime.config import SamplingParams
from specrt.runtime.drafters import Draft, LookupDrafter, ModelDrafter
from specrt.runtime.lookup import NO_PROPOSAL, Proposal
from specrt.runtime.sampling import Draws
from specrt.runtime.schedules import KeepGoing, LineFit
from specrt.runtime.schedules.constants import (
    FIRST_MODEL_ROUNDS,
    FIRST_PRIOR,
    HYBRID_EXPLORE_EVERY,
    HYBRID_MAX_VERIFY_SLOPE,
    HYBRID_MIN_VERIFY_SLOPE,
    HYBRID_PRIOR_WEIGHT,
    HYBRID_VERIFY_SMOOTHING,
    LATER_PRIOR,
    MATCH_BINS,
    MATCH_DECAY,
    MODEL_DECAY,
    MODEL_PRIOR_RATE,
    MODEL_PRIOR_ROUNDS,
)

# What the hybrid learns with (priors, decays, the verify slope's bounds, how often the model is
# measured again) is in `schedules.constants`, with the schedules' own: one place, with units.
# Proposed from a match at most (loops and copies run long); the round verifies the length with
# the most tokens per second, so a longer cap only allows more (CHANGELOG.md, 2026-12-01).
MAX_MATCH_TOKENS = 24
# A model that skipped more tokens than this (a prompt, rounds of matches) reads only the last
# of them: catching up a long prompt cost more than the model's rounds gained on such rows
# (CHANGELOG.md, 2026-12-01). Only a proposer's context: the output stays the target's.
DRAFT_WINDOW = 64
# The history of a row that has had no match yet (`outcome` gives 0-2): a row's first match
# (often its prompt's own repeat) fares unlike one after a failed match, and counted together
# the first ones taught the row to verify long matches again right after the target had left a
# copy (CHANGELOG.md, 2026-12-02).
NO_MATCH_YET = 3


class HybridDrafter:
    """Chooses per round between a `ModelDrafter` and a `LookupDrafter` (see the module)."""

    def __init__(
        self,
        model: ModelDrafter,
        lookup: LookupDrafter,
        max_match_tokens: int = MAX_MATCH_TOKENS,
    ) -> None:
        self.model, self.lookup = model, lookup
        self.max_positions = model.max_positions
        self.max_match_tokens = max_match_tokens
        self.acceptance = MatchAcceptance()
        # seconds of a verification pass vs positions fed
        self.verify_time = LineFit(HYBRID_VERIFY_SMOOTHING)
        tokens, passes = MODEL_PRIOR_RATE
        self._model_tokens = MODEL_PRIOR_ROUNDS * tokens
        self._model_passes = MODEL_PRIOR_ROUNDS * passes
        self._since_model = 0  # rounds since the model last drafted
        self._model_rounds = 0  # that drafted, ever
        self._warm = False
        self._last = NO_PROPOSAL  # the last match proposed
        self.history = NO_MATCH_YET  # how the row's last match fared (`outcome`)

    @property
    def run_time_s(self) -> float:
        return self.model.run_time_s

    def reset(self) -> None:
        self.history = NO_MATCH_YET
        self.model.reset()
        self.lookup.reset()

    def prefill(self, tokens: Sequence[int]) -> None:
        pass  # the model reads the row when it is first asked to draft (it may never be)

    def rollback(self, valid_length: int) -> None:
        self.model.rollback(valid_length)  # the model may lag: it catches up when next asked

    @property
    def model_rate(self) -> float:
        """Tokens per one-position pass of recent model rounds (over a prior)."""
        return self._model_tokens / self._model_passes

    def propose(
        self,
        tokens: list[int],
        k: int,
        sampling: SamplingParams,
        rng: Draws,
        keep_drafting: KeepGoing | None = None,
        limit: int | None = None,
    ) -> Draft:
        room = k if limit is None else limit
        found = self.lookup.find(tokens, min(room, self.max_match_tokens))
        measure = self._model_rounds < FIRST_MODEL_ROUNDS
        if k and (measure or self._since_model >= HYBRID_EXPLORE_EVERY):
            length = 0  # the model's turn, to measure it again
        else:
            length = self.match_length(found) if found.tokens else 0
        if length:
            self._last = found
            return Draft(found.tokens[:length], None, found.source)
        started = time.perf_counter()
        if k:
            self._catch_up(tokens)
        caught_up = time.perf_counter() - started
        draft = self.model.propose(tokens, k, sampling, rng, keep_drafting)
        draft.catch_up_s = caught_up
        return draft

    def _catch_up(self, tokens: list[int]) -> None:
        """Feed the model what it missed (the prompt, rounds of matches), at most the last
        `DRAFT_WINDOW`: a cost of the matches, not of the model's round (`Draft.catch_up_s`)."""
        self.model.catch_up(tokens, DRAFT_WINDOW)

    def match_length(self, found: Proposal) -> int:
        """How many of the matched tokens to verify: the most tokens per second, or 0 where
        the model's rounds do better."""
        intercept, slope = self._verify_line()  # once: this runs every round, for 24 lengths
        one = max(intercept + slope, 1e-9)
        best, best_rate = 0, 0.0
        expected_tokens = self.acceptance.expected_tokens(found, self.history)
        for length, expected in enumerate(expected_tokens, start=1):
            rate = expected * one / max(intercept + slope * (length + 1), 1e-9)
            if rate > best_rate:
                best, best_rate = length, rate
        return best if best_rate >= self.model_rate else 0

    def verify_seconds(self, positions: int) -> float:
        """Predicted time of a verification pass over ``positions`` positions."""
        intercept, slope = self._verify_line()
        return max(intercept + slope * positions, 1e-9)

    def _verify_line(self) -> tuple[float, float]:
        """The fitted verification time as intercept + slope x positions."""
        centre = self.verify_time.mean()
        if centre is None:
            return 1.0, HYBRID_MIN_VERIFY_SLOPE  # the scale cancels out: only ratios count
        x, y = centre
        slope = self.verify_time.slope
        if slope is None:
            slope = HYBRID_MIN_VERIFY_SLOPE * y
        low, high = HYBRID_MIN_VERIFY_SLOPE * y, HYBRID_MAX_VERIFY_SLOPE * y
        slope = min(max(slope, low), high)
        return y - slope * x, slope

    def observe(
        self,
        source: str,
        drafted: int,
        accepted: int,
        draft_time_s: float,
        verify_time_s: float | None,
    ) -> None:
        """Learn from a round: acceptance of a match's tokens, or the model's rate (not from
        a row's first pass, ``verify_time_s`` None: it fed the prompt's end too)."""
        if verify_time_s is None:
            if source != "model" and drafted:
                self.acceptance.record(self._last, self.history, drafted, accepted)
                self.history = outcome(drafted, accepted)
            return
        if self._warm:  # the first pass runs on cold caches: not what passes cost
            self.verify_time.add(drafted + 1, verify_time_s)
        self._warm = True
        drafting = source == "model" and drafted > 0
        self._since_model = 0 if drafting else self._since_model + 1
        self._model_rounds += drafting
        if source == "model":
            passes = (draft_time_s + verify_time_s) / self.verify_seconds(1)
            self._model_tokens = MODEL_DECAY * self._model_tokens + accepted + 1
            self._model_passes = MODEL_DECAY * self._model_passes + passes
            return
        self.acceptance.record(self._last, self.history, drafted, accepted)
        self.history = outcome(drafted, accepted)


class MatchAcceptance:
    """How often the tokens of matches are accepted: per proposer, match length, the row's
    previous match's outcome and whether the match continues the row's own output, the rate
    at which position i is accepted when the ones before it were (decayed counts over a prior:
    a match's first token is a coin flip, later ones likely, until seen)."""

    def __init__(self) -> None:
        # (source, match bin, history, from the row's output) -> per position [reached,
        # accepted]
        self.counts: dict[tuple[str, int, int, bool], list[list[float]]] = {}
        # Each key's curve as far as asked, until a record changes its counts: a batch's rows
        # share a few keys and ask every round.
        self._curves: dict[tuple[str, int, int, bool], list[float]] = {}

    def expected_tokens(self, found: Proposal, history: int = NO_MATCH_YET) -> list[float]:
        """For L = 1 .. len(found.tokens): the tokens a round verifying the first L emits,
        on average (the accepted ones and the one after them). ``history``: `outcome` of the
        row's previous match (`NO_MATCH_YET` where it had none)."""
        key, length = _key(found, history), len(found.tokens)
        curve = self._curves.get(key)
        if curve is None or len(curve) < length:
            curve = self._curves[key] = self._curve(self.counts.get(key), length)
        return curve[:length]

    @staticmethod
    def _curve(counts: list[list[float]] | None, length: int) -> list[float]:
        expected, survival, out = 1.0, 1.0, []
        for position in range(length):
            prior = FIRST_PRIOR if position == 0 else LATER_PRIOR
            if counts is None or position >= len(counts):
                rate = prior
            else:
                reached, accepted = counts[position]
                rate = (accepted + HYBRID_PRIOR_WEIGHT * prior) / (reached + HYBRID_PRIOR_WEIGHT)
            survival *= rate
            expected += survival
            out.append(expected)
        return out

    def record(self, found: Proposal, history: int, drafted: int, accepted: int) -> None:
        """``drafted`` of ``found``'s tokens were verified, the first ``accepted`` kept."""
        key = _key(found, history)
        self._curves.pop(key, None)
        counts = self.counts.setdefault(key, [])
        while len(counts) < drafted:
            counts.append([0.0, 0.0])
        for position, row in enumerate(counts):
            row[0] *= MATCH_DECAY
            row[1] *= MATCH_DECAY
            if position <= accepted and position < drafted:
                row[0] += 1.0
                row[1] += position < accepted


def outcome(drafted: int, accepted: int) -> int:
    """How a match fared, as `MatchAcceptance` tells rows apart: 0 none kept, 1 some, 2 all."""
    return 0 if accepted == 0 else 2 if accepted >= drafted else 1


def _key(found: Proposal, history: int) -> tuple[str, int, int, bool]:
    return found.source, min(found.match, MATCH_BINS), history, found.from_output

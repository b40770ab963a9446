r"""The hybrid proposer: each round, the continuation found by matching (prompt lookup, the suffix
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

from specrt.runtime.lookup import Proposal
from specrt.runtime.schedules import LineFit
from specrt.runtime.schedules.base import computed_positions
from specrt.runtime.schedules.constants import (
    CORPUS_FIRST_PRIORS,
    CORPUS_LATER_PRIOR,
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


class HybridChoice:
    """Chooses per round between a row's match and the draft model (see the module). Shared by
    the lone rows of one configuration (what it learns holds for the pair); a row's own state
    (how its last match fared) is passed in."""

    def __init__(self, max_match_tokens: int = MAX_MATCH_TOKENS, even_rows: bool = False) -> None:
        self.max_match_tokens = max_match_tokens
        # The target's calls compute an even number of positions (`make_schedule`'s
        # ``even_rows``): a pass over one position costs what one over two does, so the line
        # is fitted and read at even counts, and a one-token match costs nothing more.
        self.even_rows = even_rows
        self.acceptance = MatchAcceptance()
        # seconds of a verification pass vs positions fed
        self.verify_time = LineFit(HYBRID_VERIFY_SMOOTHING)
        tokens, passes = MODEL_PRIOR_RATE
        self._model_tokens = MODEL_PRIOR_ROUNDS * tokens
        self._model_passes = MODEL_PRIOR_ROUNDS * passes
        self._since_model = 0  # rounds since the model last drafted
        self._model_rounds = 0  # that drafted, ever
        self._warm = False

    @property
    def model_rate(self) -> float:
        """Tokens per one-position pass of recent model rounds (over a prior)."""
        return self._model_tokens / self._model_passes

    def choose(self, found: Proposal, k: int, history: int = NO_MATCH_YET) -> int:
        """How many of the matched tokens ``found`` to verify this round (0: the model drafts,
        K = ``k``). Until the model has drafted `FIRST_MODEL_ROUNDS` rounds, and every
        `HYBRID_EXPLORE_EVERY` rounds without it, the model drafts anyway, to be measured."""
        measure = self._model_rounds < FIRST_MODEL_ROUNDS
        if k and (measure or self._since_model >= HYBRID_EXPLORE_EVERY):
            return 0
        # Where the model does not draft this round (its guard holds it off), a match need
        # only beat a plain round: one token a pass.
        rival = self.model_rate if k else 1.0
        return self.match_length(found, history, rival) if found.tokens else 0

    def match_length(
        self, found: Proposal, history: int = NO_MATCH_YET, rival: float | None = None
    ) -> int:
        """How many of the matched tokens to verify: the most tokens per second, or 0 where
        ``rival`` (tokens per one-position pass; default: the model's rounds') does better
        (``history``: how the row's last match fared)."""
        intercept, slope = self._verify_line()  # once: this runs every round, for 24 lengths
        one = max(intercept + slope * self._positions(1), 1e-9)
        best, best_rate = 0, 0.0
        expected_tokens = self.acceptance.expected_tokens(found, history)
        for length, expected in enumerate(expected_tokens, start=1):
            rate = expected * one / max(intercept + slope * self._positions(length + 1), 1e-9)
            if rate > best_rate:
                best, best_rate = length, rate
        return best if best_rate >= (self.model_rate if rival is None else rival) else 0

    def verify_seconds(self, positions: int) -> float:
        """Predicted time of a verification pass over ``positions`` positions."""
        intercept, slope = self._verify_line()
        return max(intercept + slope * self._positions(positions), 1e-9)

    def _positions(self, positions: int) -> int:
        """The positions a pass over ``positions`` computes."""
        return computed_positions(positions, self.even_rows)

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
        found: Proposal | None,
        history: int,
        drafted: int,
        accepted: int,
        draft_time_s: float,
        verify_time_s: float | None,
    ) -> int:
        """Learn from a round that verified the match ``found`` (None: the model's draft, or
        the target alone): that match's acceptance, or the model's rate (not from a row's
        first pass, ``verify_time_s`` None: it fed the prompt's end too). Returns the row's
        history for its next match (`outcome`)."""
        if verify_time_s is None:
            if found is not None and drafted:
                self.acceptance.record(found, history, drafted, accepted)
                return outcome(drafted, accepted)
            return history
        if self._warm:  # the first pass runs on cold caches: not what passes cost
            self.verify_time.add(self._positions(drafted + 1), verify_time_s)
        self._warm = True
        drafting = found is None and drafted > 0
        self._since_model = 0 if drafting else self._since_model + 1
        self._model_rounds += drafting
        if found is None:
            passes = (draft_time_s + verify_time_s) / self.verify_seconds(1)
            self._model_tokens = MODEL_DECAY * self._model_tokens + accepted + 1
            self._model_passes = MODEL_DECAY * self._model_passes + passes
            return history
        self.acceptance.record(found, history, drafted, accepted)
        return outcome(drafted, accepted)


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
            curve = self._curves[key] = self._curve(self.counts.get(key), length, _priors(key))
        return curve[:length]

    @staticmethod
    def _curve(
        counts: list[list[float]] | None, length: int, priors: tuple[float, float]
    ) -> list[float]:
        expected, survival, out = 1.0, 1.0, []
        for position in range(length):
            prior = priors[position > 0]
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


def _priors(key: tuple[str, int, int, bool]) -> tuple[float, float]:
    """The prior acceptance of a proposal's first token and of the ones after it."""
    if key[0] == "corpus":
        return CORPUS_FIRST_PRIORS[key[1] - 1], CORPUS_LATER_PRIOR
    return FIRST_PRIOR, LATER_PRIOR


def _key(found: Proposal, history: int) -> tuple[str, int, int, bool]:
    if found.confidence:  # a corpus's: its backing tells more than the row's last match
        return found.source, found.confidence, NO_MATCH_YET, False
    return found.source, min(found.match, MATCH_BINS), history, found.from_output

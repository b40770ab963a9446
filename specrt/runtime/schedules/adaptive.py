r"""The adaptive draft-length schedule (one row): stop drafting when one more draft token no
longer pays for itself. Drafting token :math:`j+1` costs :math:`t_d + \Delta v` (a draft step and
one more position in the verification pass) and gains a token only if tokens :math:`1..j+1` are
all accepted. A round maximises tokens per second by drafting on while that expected gain per
second beats the rate :math:`R` (tokens per second) rounds achieve:

.. math:: S_j \, a(c_j) \ge R\,(t_d + \Delta v), \qquad S_j = \prod_{i \le j} a(c_i)

where :math:`c_i` is the draft's probability of its token :math:`i` (its top one when greedy) and
:math:`a(c)` the probability that a token drafted with confidence :math:`c` is accepted when the
tokens before it were: :math:`S_j` is the chance that all :math:`j` drafted tokens survive, and
the next token's acceptance is estimated by the last one's. :math:`a` is learned online per
confidence bin (decayed counts over a prior) from every drafted token the verifier reached.
Before the first token the gain is the recent first-token acceptance.
:math:`t_d` is the measured time between two drafted tokens (a round's first draft step costs
more: it runs on caches the target just evicted), :math:`\Delta v` the slope of a line fitted to
verification time against tokens fed (bounded: a few slow rounds must not stop drafting for
good), :math:`R` the ratio of decayed sums of tokens and seconds; so the choice follows the text,
the pair and the machine. A target whose calls compute an even number of positions
(``even_rows``) verifies a round of an even K (an odd number of positions) at the cost of one
more: drafting that token costs only :math:`t_d`. After `ADAPTIVE_EXPLORE_EVERY` (32) rounds
without drafting one round drafts anyway, to measure again. The draft never looks at the
target before it stops, so the output is the same as with a fixed K.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from specrt.runtime.schedules.base import KeepGoing
from specrt.runtime.schedules.constants import (
    ADAPTIVE_BINS,
    ADAPTIVE_DECAY,
    ADAPTIVE_EXPLORE_EVERY,
    ADAPTIVE_MAX_STEP,
    ADAPTIVE_MAX_VERIFY_SLOPE,
    ADAPTIVE_PRIOR_DRIFT,
    ADAPTIVE_PRIOR_WEIGHT,
    ADAPTIVE_SMOOTHING,
    PRIOR_ACCEPTANCE,
)
from specrt.runtime.schedules.estimators import LineFit, moving_average


class AdaptiveSchedule:
    """The adaptive schedule: per-generator state, called by the loop between model calls.

    Plain Python floats: this runs between model calls, where every microsecond counts."""

    def __init__(
        self,
        k_max: int,
        prior_weight: float = ADAPTIVE_PRIOR_WEIGHT,
        decay: float = ADAPTIVE_DECAY,
        smoothing: float = ADAPTIVE_SMOOTHING,
        clock: Callable[[], float] = time.perf_counter,
        even_rows: bool = False,
    ) -> None:
        self.k_max = k_max
        self.even_rows = even_rows
        self.clock = clock
        self.decay = decay
        self.smoothing = smoothing
        # Per confidence bin: decayed counts of reached tokens and of accepted ones, scaled by
        # self._weight (which grows each round instead of every count shrinking), over a prior
        # between the bin's confidence and 1: an untried bin looks worth drafting on.
        self.prior_weight = prior_weight
        self.prior = [(1 + (i + 0.5) / ADAPTIVE_BINS) / 2 for i in range(ADAPTIVE_BINS)]
        self.accepted = [0.0] * ADAPTIVE_BINS
        self.reached = [0.0] * ADAPTIVE_BINS
        self._weight = 1.0
        self.first_acceptance = PRIOR_ACCEPTANCE  # of a round's first draft token
        self.draft_step_s: float | None = None  # per drafted token, moving average
        self._steps_timed = 0  # steps timed between two drafted tokens
        self.verify_s: float | None = None  # per verification pass, moving average
        self.verify_time = LineFit(smoothing)  # seconds vs tokens fed to the target
        self.rounds_without_draft = 0
        self._tokens = self._seconds = 0.0  # decayed sums over rounds, for the rate
        self.threshold: float | None = None  # rate x marginal cost, once both are measured
        self.keep_drafting: KeepGoing = self._keep_drafting
        self._limit = 0
        self._bins: list[int] = []
        self._survival = 1.0
        self._last_step_at: float | None = None

    def acceptance(self, confidence: float) -> float:
        """Learned P(a token drafted with this confidence is accepted | the ones before were)."""
        index = min(int(confidence * ADAPTIVE_BINS), ADAPTIVE_BINS - 1)
        return self._estimate(index)

    @property
    def rate(self) -> float | None:
        """Tokens per second of recent rounds."""
        return self._tokens / self._seconds if self._seconds else None

    @property
    def marginal_cost_s(self) -> float | None:
        """Time one more draft token adds to a round: a draft step and a verified position.

        The verify slope comes from a line fit over rounds whose K differs little, which timing
        noise throws far off; it is kept within 10% of a verification pass per position
        (measured on the demo target: 4-8%)."""
        if self.draft_step_s is None or self.verify_s is None:
            return None
        slope = self.verify_time.slope
        cap = ADAPTIVE_MAX_VERIFY_SLOPE * self.verify_s
        return self.draft_step_s + (cap if slope is None else min(slope, cap))

    # -- within a round --------------------------------------------------------------------------
    def start_round(self, limit: int) -> int:
        self._limit = min(limit, self.k_max)
        self._bins = []
        self._survival = 1.0
        self._last_step_at = None
        if self._limit <= 0:
            return 0
        if self.threshold is None or self.rounds_without_draft >= ADAPTIVE_EXPLORE_EVERY:
            return self._limit  # measuring: _keep_drafting varies K
        return self._limit if self.first_acceptance >= self._threshold(0) else 0

    def _keep_drafting(self, drafted: int, confidence: float) -> bool:
        """Called after each drafted token with its confidence; False stops the round."""
        now = self.clock()
        if self._last_step_at is not None:  # the time between two drafted tokens
            step = now - self._last_step_at
            if self.draft_step_s is not None:  # one slow step must not stop drafting
                step = min(step, ADAPTIVE_MAX_STEP * self.draft_step_s)
            # The mean of the first steps, then a moving average: the first round's estimate
            # (its first step on cold caches, a head reading the round's tokens) is several
            # steps' worth, and would hold K down for tens of rounds.
            self._steps_timed += 1
            weight = max(self.smoothing, 1.0 / self._steps_timed)
            self.draft_step_s = moving_average(self.draft_step_s, step, weight)
        self._last_step_at = now
        index = min(int(confidence * ADAPTIVE_BINS), ADAPTIVE_BINS - 1)
        self._bins.append(index)
        acceptance = self._estimate(index)
        self._survival *= acceptance
        if drafted >= self._limit:
            return False
        if self.threshold is None:  # not measured yet: vary K to learn the costs
            return drafted < 1 + len(self.verify_time) % self.k_max
        if self.rounds_without_draft >= ADAPTIVE_EXPLORE_EVERY:  # re-measure now and then
            return drafted < max(1, self.k_max // 2)
        return self._survival * acceptance >= self._threshold(drafted)

    def _threshold(self, drafted: int) -> float:
        """What the next draft token must gain per round: the rate times what it adds to the
        round, only a draft step where its position's verification is computed anyway."""
        if self.even_rows and drafted % 2 == 0 and self.draft_step_s is not None:
            return self.rate * self.draft_step_s
        return self.threshold

    def _estimate(self, index: int) -> float:
        weight = self._weight
        return (self.accepted[index] / weight + self.prior_weight * self.prior[index]) / (
            self.reached[index] / weight + self.prior_weight
        )

    # -- after a round ---------------------------------------------------------------------------
    def update(
        self, drafted: int, accepted: int, draft_time_s: float, verify_time_s: float
    ) -> None:
        """Record a round: ``drafted`` proposed, ``accepted`` kept, and what each part took."""
        if drafted:
            self._weight /= self.decay  # older counts weigh less: newer ones count more
            if self._weight > 1e6:
                self._rescale()
            weight = self._weight
            # Tokens the verifier reached: the accepted ones and the first rejected one.
            for position, index in enumerate(self._bins[: accepted + 1]):
                self.reached[index] += weight
                if position < accepted:
                    self.accepted[index] += weight
            first = float(accepted >= 1)
            self.first_acceptance += self.smoothing * (first - self.first_acceptance)
            # Until steps are timed between two tokens: a round's first step also pays for
            # cold caches (and a head for reading the round's tokens), so a round of one step
            # says too little; while it stays unknown, rounds vary K (`_keep_drafting`).
            if self.draft_step_s is None and (drafted > 1 or self.k_max == 1):
                self.draft_step_s = draft_time_s / drafted
            self.rounds_without_draft = 0
        else:
            # No evidence: drift slowly back to the prior so drafting gets retried now and then.
            self.rounds_without_draft += 1
            drift = ADAPTIVE_PRIOR_DRIFT * self.smoothing
            self.first_acceptance += drift * (PRIOR_ACCEPTANCE - self.first_acceptance)
        self.verify_time.add(drafted + 1, verify_time_s)
        self.verify_s = moving_average(self.verify_s, verify_time_s, self.smoothing)
        keep = 1 - self.smoothing
        self._tokens = keep * self._tokens + accepted + 1
        self._seconds = keep * self._seconds + draft_time_s + verify_time_s
        cost = self.marginal_cost_s
        self.threshold = None if cost is None else self.rate * cost

    def _rescale(self) -> None:
        for counts in (self.accepted, self.reached):
            counts[:] = [c / self._weight for c in counts]
        self._weight = 1.0

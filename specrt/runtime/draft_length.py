r"""Adaptive draft length: stop drafting when one more draft token no longer pays for itself.

Drafting token :math:`j+1` costs :math:`t_d + \Delta v` (a draft step and one more position in
the verification pass) and pays off only if tokens :math:`1..j+1` are all accepted. A round is
worth drafting on while that marginal gain per second beats the rate :math:`R` (tokens per second)
recent rounds achieved:

.. math:: P(\text{tokens } 1..j{+}1 \text{ accepted} \mid c_j) \ge R\,(t_d + \Delta v)

where :math:`c_j` is the draft's confidence (top probability) in token :math:`j`. That probability
is learned online per confidence bin (decayed counts, optimistic prior :math:`c`) from rounds that
did draft token :math:`j+1`. Before the first token it is the recent first-token acceptance.
:math:`t_d` is the measured time between two drafted tokens (a round's first draft step costs
more: it runs on caches the target just used), :math:`\Delta v` the slope of a line
fitted to verification time against tokens fed (bounded: a few slow rounds must not stop drafting
for good), :math:`R` a moving average; so the choice follows the text, the pair and the machine.
After 32 rounds without drafting one round drafts anyway, to measure again.
The draft never looks at the target before it stops, so the output is the same as with a fixed K.
"""

from __future__ import annotations

import time
from collections.abc import Callable

BINS = 10
PRIOR_ACCEPTANCE = 0.6
MAX_VERIFY_SLOPE = 0.1  # of a verification pass, per extra position
EXPLORE_EVERY = 32  # rounds without drafting before one is drafted anyway, to re-measure


class DraftLengthController:
    """Per-generator state; `start_round` / `keep_drafting` / `update` are called by the loop.

    Plain Python floats: this runs between model calls, where every microsecond counts."""

    def __init__(
        self,
        k_max: int,
        prior_weight: float = 4.0,
        decay: float = 0.995,
        smoothing: float = 0.05,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.k_max = k_max
        self.clock = clock
        self.decay = decay
        self.smoothing = smoothing
        centers = [(i + 0.5) / BINS for i in range(BINS)]
        # Per confidence bin of token j: how often tokens 1..j+1 were all accepted.
        self.prior_paid = [c * prior_weight for c in centers]  # optimistic: unexplored get tried
        self.prior_seen = [prior_weight] * BINS
        self.paid = list(self.prior_paid)
        self.seen = list(self.prior_seen)
        self.first_acceptance = PRIOR_ACCEPTANCE  # of a round's first draft token
        self.draft_step_s: float | None = None  # per drafted token, moving average
        self.verify_s: float | None = None  # per verification pass, moving average
        self.verify_time = LineFit(smoothing)  # seconds vs tokens fed to the target
        self.rounds_without_draft = 0
        self.rate: float | None = None  # tokens per second of recent rounds
        self.threshold: float | None = None  # rate x marginal cost, once both are measured
        self._bins: list[int] = []
        self._last_step_at: float | None = None

    @property
    def marginal_cost_s(self) -> float | None:
        """Time one more draft token adds to a round: a draft step and a verified position.

        The verify slope comes from a line fit over rounds whose K differs little, which timing
        noise throws far off; it is kept within 10% of a verification pass per position
        (measured on the demo target: 4-8%)."""
        if self.draft_step_s is None or self.verify_s is None:
            return None
        slope = self.verify_time.slope
        cap = MAX_VERIFY_SLOPE * self.verify_s
        return self.draft_step_s + (cap if slope is None else min(slope, cap))

    # -- within a round --------------------------------------------------------------------------
    def start_round(self) -> None:
        self._bins = []
        self._last_step_at: float | None = None

    def keep_drafting(self, drafted: int, confidence: float | None = None) -> bool:
        """Called before drafting (``drafted == 0``) and after each drafted token with its
        confidence; False stops the round's drafting."""
        gain = self.first_acceptance
        if drafted:  # the time between two drafted tokens is what one more costs
            now = self.clock()
            if self._last_step_at is not None:
                step = now - self._last_step_at
                if self.draft_step_s is not None:  # one slow step must not stop drafting
                    step = min(step, 3 * self.draft_step_s)
                self.draft_step_s = _average(self.draft_step_s, step, self.smoothing)
            self._last_step_at = now
        if confidence is not None:
            index = min(int(confidence * BINS), BINS - 1)
            self._bins.append(index)
            gain = self.paid[index] / self.seen[index]
        if drafted >= self.k_max:
            return False
        if self.threshold is None:  # not measured yet: vary K to learn the costs
            return drafted < 1 + len(self.verify_time) % self.k_max
        if self.rounds_without_draft >= EXPLORE_EVERY:  # re-measure now and then
            return drafted < max(1, self.k_max // 2)
        return gain >= self.threshold

    # -- after a round ---------------------------------------------------------------------------
    def update(
        self, drafted: int, accepted: int, draft_time_s: float, verify_time_s: float
    ) -> None:
        """Record a round: ``drafted`` proposed, ``accepted`` kept, and what each part took."""
        if drafted:
            keep, pull = self.decay, 1 - self.decay
            for i in range(BINS):
                self.paid[i] = keep * self.paid[i] + pull * self.prior_paid[i]
                self.seen[i] = keep * self.seen[i] + pull * self.prior_seen[i]
            # Token j's bin learns whether drafting j+1 paid, when j+1 was drafted (recording
            # only the settled "no"s of stopped rounds would bias it down).
            for j, index in enumerate(self._bins[: drafted - 1], start=1):
                self.seen[index] += 1
                self.paid[index] += accepted >= j + 1
            first = float(accepted >= 1)
            self.first_acceptance += self.smoothing * (first - self.first_acceptance)
            if self.draft_step_s is None:  # until steps were timed (the first step of a round
                self.draft_step_s = draft_time_s / drafted  # also pays for cold caches)
            self.rounds_without_draft = 0
        else:
            # No evidence: drift slowly back to the prior so drafting gets retried now and then.
            self.rounds_without_draft += 1
            drift = 0.1 * self.smoothing
            self.first_acceptance += drift * (PRIOR_ACCEPTANCE - self.first_acceptance)
        self.verify_time.add(drafted + 1, verify_time_s)
        self.verify_s = _average(self.verify_s, verify_time_s, self.smoothing)
        tokens_per_s = (accepted + 1) / (draft_time_s + verify_time_s)
        self.rate = _average(self.rate, tokens_per_s, self.smoothing)
        cost = self.marginal_cost_s
        self.threshold = None if cost is None else self.rate * cost


def _average(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


class LineFit:
    """Least-squares line y = a + b x over exponentially decayed observations."""

    def __init__(self, smoothing: float) -> None:
        self.smoothing = smoothing
        self._sums = [0.0] * 5  # n, sum x, sum x^2, sum y, sum xy
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, x: float, y: float) -> None:
        keep = 1 - self.smoothing
        self._sums = [keep * a + b for a, b in zip(self._sums, (1.0, x, x * x, y, x * y))]
        self._count += 1

    @property
    def slope(self) -> float | None:
        """None until two different x have been seen."""
        n, sx, sxx, sy, sxy = self._sums
        spread = n * sxx - sx * sx
        if spread <= 1e-6 * n * n:
            return None
        return max(0.0, (n * sxy - sx * sy) / spread)


class HeuristicController:
    """The classic schedule, for comparison: K grows by 2 after a fully accepted round and
    shrinks by 1 otherwise (as transformers' ``num_assistant_tokens_schedule="heuristic"``)."""

    def __init__(self, k_max: int, start: int = 4) -> None:
        self.k_max = k_max
        self.k = min(start, k_max)

    def start_round(self) -> None:
        pass

    def keep_drafting(self, drafted: int, confidence: float | None = None) -> bool:
        return drafted < self.k

    def update(
        self, drafted: int, accepted: int, draft_time_s: float, verify_time_s: float
    ) -> None:
        if drafted and accepted == drafted:
            self.k = min(self.k_max, self.k + 2)
        else:
            self.k = max(1, self.k - 1)

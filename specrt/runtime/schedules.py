r"""Draft-length schedules: how many tokens to draft each round. Fixed, adaptive (below), or the
classic +2/-1 heuristic; the loop asks each the same questions (`DraftSchedule`).

Adaptive: stop drafting when one more draft token no longer pays for itself. Drafting token
:math:`j+1` costs :math:`t_d + \Delta v` (a draft step and one more position in the verification
pass) and gains a token only if tokens :math:`1..j+1` are all accepted. A round maximises tokens
per second by drafting on while that expected gain per second beats the rate :math:`R` (tokens
per second) rounds achieve:

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
the pair and the machine. After 32 rounds without drafting one round drafts anyway, to measure
again. The draft never looks at the target before it stops, so the output is the same as with a
fixed K.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import numpy as np

BINS = 10
PRIOR_ACCEPTANCE = 0.6
MAX_VERIFY_SLOPE = 0.1  # of a verification pass, per extra position
EXPLORE_EVERY = 32  # rounds without drafting before one is drafted anyway, to re-measure

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


def make_schedule(name: str, k_max: int) -> DraftSchedule:
    """The schedule ``name`` (one of `config.DRAFT_SCHEDULES`), drafting at most ``k_max``."""
    if name == "adaptive":
        return AdaptiveSchedule(k_max)
    return {"fixed": FixedSchedule, "heuristic": HeuristicSchedule}[name](k_max)


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


class AdaptiveSchedule:
    """The adaptive schedule: per-generator state, called by the loop between model calls.

    Plain Python floats: this runs between model calls, where every microsecond counts."""

    def __init__(
        self,
        k_max: int,
        prior_weight: float = 2.0,
        decay: float = 0.995,
        smoothing: float = 0.05,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.k_max = k_max
        self.clock = clock
        self.decay = decay
        self.smoothing = smoothing
        # Per confidence bin: decayed counts of reached tokens and of accepted ones, scaled by
        # self._weight (which grows each round instead of every count shrinking), over a prior
        # between the bin's confidence and 1: an untried bin looks worth drafting on.
        self.prior_weight = prior_weight
        self.prior = [(1 + (i + 0.5) / BINS) / 2 for i in range(BINS)]
        self.accepted = [0.0] * BINS
        self.reached = [0.0] * BINS
        self._weight = 1.0
        self.first_acceptance = PRIOR_ACCEPTANCE  # of a round's first draft token
        self.draft_step_s: float | None = None  # per drafted token, moving average
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
        index = min(int(confidence * BINS), BINS - 1)
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
        cap = MAX_VERIFY_SLOPE * self.verify_s
        return self.draft_step_s + (cap if slope is None else min(slope, cap))

    # -- within a round --------------------------------------------------------------------------
    def start_round(self, limit: int) -> int:
        self._limit = min(limit, self.k_max)
        self._bins = []
        self._survival = 1.0
        self._last_step_at = None
        if self._limit <= 0:
            return 0
        if self.threshold is None or self.rounds_without_draft >= EXPLORE_EVERY:
            return self._limit  # measuring: _keep_drafting varies K
        return self._limit if self.first_acceptance >= self.threshold else 0

    def _keep_drafting(self, drafted: int, confidence: float) -> bool:
        """Called after each drafted token with its confidence; False stops the round."""
        now = self.clock()
        if self._last_step_at is not None:  # the time between two drafted tokens
            step = now - self._last_step_at
            if self.draft_step_s is not None:  # one slow step must not stop drafting
                step = min(step, 3 * self.draft_step_s)
            self.draft_step_s = _average(self.draft_step_s, step, self.smoothing)
        self._last_step_at = now
        index = min(int(confidence * BINS), BINS - 1)
        self._bins.append(index)
        acceptance = self._estimate(index)
        self._survival *= acceptance
        if drafted >= self._limit:
            return False
        if self.threshold is None:  # not measured yet: vary K to learn the costs
            return drafted < 1 + len(self.verify_time) % self.k_max
        if self.rounds_without_draft >= EXPLORE_EVERY:  # re-measure now and then
            return drafted < max(1, self.k_max // 2)
        return self._survival * acceptance >= self.threshold

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
        keep = 1 - self.smoothing
        self._tokens = keep * self._tokens + accepted + 1
        self._seconds = keep * self._seconds + draft_time_s + verify_time_s
        cost = self.marginal_cost_s
        self.threshold = None if cost is None else self.rate * cost

    def _rescale(self) -> None:
        for counts in (self.accepted, self.reached):
            counts[:] = [c / self._weight for c in counts]
        self._weight = 1.0


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

    def mean(self) -> tuple[float, float] | None:
        """The (x, y) centre of the observations (None before the first); the line passes
        through it."""
        n, sx, _, sy, _ = self._sums
        return (sx / n, sy / n) if n else None


class HeuristicSchedule:
    """The classic schedule, for comparison: K grows by 2 after a fully accepted round and
    shrinks by 1 otherwise (as transformers' ``num_assistant_tokens_schedule="heuristic"``).
    It decides K before the round, so it needs no per-token callback."""

    keep_drafting = None

    def __init__(self, k_max: int, start: int = 4) -> None:
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


LOAD_EXPLORE_EVERY = 32  # rounds between re-measuring a neighbour of the best K, at first
LOAD_DECAY = 0.98  # per drafting round, of the acceptance counts
LOAD_WINDOW = 24  # round times kept per K and batch size
LOAD_MARGIN = 0.03  # by which more drafting must beat less to be chosen
LOAD_EXPLORE_SHARE = 0.02  # of the rounds' time, at most, spent re-measuring K
# The cost of verifying one more token of matches in every row, as a share of a round without
# them, assumed until rounds of that width are measured (low, so that they are tried).
MATCH_PRIOR_COST = 0.25
# The fitted cost of one more token of matches is taken as at least this share of the average
# cost of a token of the widest measured width (a flat or noisy fit would make every wider one
# look free).
MATCH_MIN_SLOPE = 0.5


class RoundTimes:
    """Recent times of one kind of round (`LoadSchedule._relative`), kept apart for each batch
    size: a job's tail (fewer rows) must not be priced from, nor evict, the full batch's many
    rounds."""

    def __init__(self) -> None:
        self.by_size: dict[int, deque[float]] = {}
        self._medians: dict[int, float] = {}  # asked for every round, changed by one size

    def add(self, rows: int, seconds: float) -> None:
        self.by_size.setdefault(rows, deque(maxlen=LOAD_WINDOW)).append(seconds)
        self._medians.pop(rows, None)

    def __len__(self) -> int:
        return sum(map(len, self.by_size.values()))

    def median(self, rows: int) -> float:
        if rows not in self._medians:
            self._medians[rows] = statistics.median(self.by_size[rows])
        return self._medians[rows]

    def predict(self, rows: int) -> float:
        """Seconds of a round of ``rows`` rows: the median of that size's rounds where measured,
        else a line through the medians of the nearest measured sizes on either side (the two
        nearest beyond the range; a constant while only one size is measured)."""
        if rows in self.by_size:
            return self.median(rows)
        sizes = sorted(self.by_size)
        if len(sizes) == 1:
            return self.median(sizes[0])
        below = [n for n in sizes if n < rows][-2:]
        above = [n for n in sizes if n > rows][:2]
        if below and above:
            low, high = below[-1], above[0]
        else:
            low, high = below or above
        t_low, t_high = self.median(low), self.median(high)
        slope = max((t_high - t_low) / (high - low), 0.0)
        return max(t_low + slope * (rows - low), 1e-6)


class _CheckSpacing:
    """When to measure a neighbour of the best choice again: after `LOAD_EXPLORE_EVERY` rounds,
    then twice as long each time the best held since the last check (up to 16x)."""

    def __init__(self) -> None:
        self.rounds, self.every, self.best = 0, LOAD_EXPLORE_EVERY, -1

    def tick(self) -> bool:
        """Count a round; whether a check is due."""
        self.rounds += 1
        return self.rounds >= self.every

    def restart(self, best: int) -> None:
        """A check of a neighbour of ``best`` starts now."""
        held = best == self.best
        self.every = min(16 * LOAD_EXPLORE_EVERY, 2 * self.every) if held else LOAD_EXPLORE_EVERY
        self.rounds, self.best = 0, best


class LoadSchedule:
    """K for a batched round of n rows, from what rounds have cost.

    Drafting pays less as the batch grows: verifying n * (K+1) positions stops being free, and
    so does each draft step. For each K the schedule keeps the times of its recent rounds with
    their batch sizes (the target alone's in seconds, the others' as multiples of the target
    alone's rounds at the time: rows grow through a job; the first round of each K warms caches
    and is dropped) and predicts a round of n rows by a line through the median at each batch
    size seen (a constant until two sizes are seen: the choice rests on the ratios between K,
    which change slowly with n). For each draft position i it keeps the rate a_i at which the
    token is accepted when reached (decayed counts over a prior). It picks the K with the most
    expected tokens per second:

    .. math:: \\arg\\max_K \\frac{1 + \\sum_{j=1}^{K} \\prod_{i \\le j} a_i}{T(n, K)}

    K = 0 (the target alone) is one of the choices, so a batch where drafting does not pay
    runs as fast as one without it. K = 0 (at each batch size) is measured first, then, where
    rows have matches, a width of them (`matches_measured`: the runner probes it), and K = 1,
    then K + 1 while the best K so far is the largest measured (rates are unimodal in K: each extra
    token gains less and costs as much). Costs and acceptance drift, so a neighbour of the best
    (every third time the target alone, the rounds the others are priced against) is measured
    again after `LOAD_EXPLORE_EVERY` rounds, then half as often each time the best held, and only
    once the rounds since the last check took 1 / `LOAD_EXPLORE_SHARE` times what it cost (its
    round beyond one of the best, and the draft's catch-up after rounds without drafting,
    `charge`): at most that share of the time goes to checks.
    ``adapt=False``: always the largest K allowed (the "fixed" schedule)."""

    def __init__(self, adapt: bool = True) -> None:
        self.adapt = adapt
        self.times: dict[int, RoundTimes] = {}  # by K
        # by width: rounds without a model draft verifying that many tokens of matches
        self.match_times: dict[int, RoundTimes] = {}
        self._warmed: set[int | tuple[str, int]] = set()
        self.reached: list[float] = []  # per draft position: decayed counts
        self.accepted: list[float] = []
        self._k_checks = _CheckSpacing()
        self.last_k: int | None = None  # the K chosen last
        self._turn = 0  # which K a check measures: below the best, above, the target alone
        self._width_checks, self._width_side = _CheckSpacing(), 1
        self._since_seconds, self._check_cost = 0.0, 0.0  # round time since, cost of, a check
        self._checking: int | None = None  # the best K, while a check's round runs
        self._catch_up_s: float | None = None  # per token the draft catches up on
        self._backlog = 0  # tokens it would catch up on before a round drafting now
        self._without_draft: float | None = None  # tokens/s of the round without a model draft

    def choose(
        self, rows: int, k_max: int, backlog: int = 0, without_draft: float | None = None
    ) -> int:
        """K for a round of ``rows`` rows; ``backlog``: tokens the draft would have to catch up
        on first (after rounds without drafting), which a check must repay too;
        ``without_draft``: the expected tokens per second of this round without a model draft
        where its rows' matches would be verified (`match_option`), else that of the target
        alone is used: a model draft must beat what the round gets without it."""
        self._backlog = backlog
        self._without_draft = without_draft
        self.last_k = self._choose(rows, k_max)
        return self.last_k

    def _choose(self, rows: int, k_max: int) -> int:
        if not self.adapt:
            return k_max
        if not self.measured_alone(rows):
            return 0
        known = [k for k in range(k_max + 1) if len(self.times.get(k, ())) >= 2]
        if k_max and 1 not in known:  # one draft token next
            return 1
        rates = {k: self.rate(rows, k) for k in known}
        rates[0] = max(rates[0], self._without_draft or 0.0)
        best = 0
        for k in known:  # a longer draft must beat a shorter one clearly: round times are noisy
            if rates[k] > rates[best] * (1 + LOAD_MARGIN):
                best = k
        if best < k_max and best + 1 not in known:  # climb while one more token pays
            return best + 1
        turn_came = self._k_checks.tick()
        cost = max(self._check_cost, self._backlog * (self._catch_up_s or 0.0))
        repaid = self._since_seconds * LOAD_EXPLORE_SHARE >= cost
        if turn_came and repaid:  # re-measure a neighbour
            self._k_checks.restart(best)
            self._since_seconds, self._check_cost, self._checking = 0.0, 0.0, best
            # Below, above, and (every third check) the target alone: the rounds every other
            # K is priced against, which are not measured again while the best K is above 1.
            self._turn = (self._turn + 1) % 3
            if self._turn == 2 and best >= 2:
                return 0
            side = -1 if self._turn == 1 else 1
            neighbour = best + side
            return neighbour if 0 <= neighbour <= k_max else best - side
        return best

    def measured_alone(self, rows: int) -> bool:
        """Whether rounds of the target alone (K = 0, no matches) were measured at this batch
        size (and twice in all): what every K and width is weighed against, measured first.
        A job's tail comes after its full batch: priced from there, the target alone's
        round would look dear, and drafting a bargain."""
        plain = self.times.get(0)
        return plain is not None and len(plain) >= 2 and rows in plain.by_size

    def matches_measured(self) -> bool:
        """Whether rounds verifying matches (without a model draft) were measured, at some
        width."""
        return any(len(times) >= 2 for times in self.match_times.values())

    def rate(self, rows: int, k: int) -> float:
        """Expected tokens per second of a round of ``rows`` rows drafting ``k``."""
        return rows * self.expected_tokens(k) / self.predicted_seconds(rows, k)

    def match_option(
        self, rows: int, curves: list[list[float]], probe: bool = False
    ) -> tuple[int, float | None]:
        """How many tokens of matches a round of ``rows`` rows without a model draft verifies
        (0: none), and the round's expected tokens per second (None: not known yet).
        ``curves``: for each row with a match, the tokens it is expected to emit when 1, 2, ...
        of them are verified (`MatchAcceptance.expected_tokens`); the other rows emit one.
        The width with the most expected tokens per second, by the measured times of rounds of
        each width; a width not measured yet is priced on from the widest narrower one
        measured at the cost of one more token fitted over the measured widths (with one
        measured: its average cost per token; before any: `MATCH_PRIOR_COST` of a round
        without matches), so widths are tried one after another while they pay. A width is kept as
        long as it is the best; a neighbour of it is measured again as K's are
        (`LOAD_EXPLORE_EVERY` rounds, half as often each time the best held): a width measured
        on a slow round would otherwise never be tried again (a server settled on 1 token of
        its rows' matches, 4.2 tokens/ms, where 3 gave 5.2); ``probe``: that check now."""
        widest = max(map(len, curves), default=0)
        if not self.adapt:
            return widest, None
        if not self.measured_alone(rows):
            return 0, None  # rounds without matches first: what the widths are compared with
        plain = self.predicted_seconds(rows, 0)
        rates = [rows / plain]
        # Widths not measured: a line on from the widest measured one, by the cost of one
        # more token fitted over the measured widths (the first token of a match costs more
        # than the ones after it: a line from the round without matches overprices them).
        line = LineFit(0.0)
        last, last_seconds, per_token = 0, plain, MATCH_PRIOR_COST * plain
        # the tokens of every width: a row's curve stays at its end past its match's length
        padded = [c + c[-1:] * (widest - len(c)) for c in curves]
        tokens_by_width = (rows - len(curves) + np.sum(padded, axis=0)).tolist() if curves else []
        for width, tokens in enumerate(tokens_by_width, 1):
            measured = self.match_times.get(width)
            if measured is not None and len(measured) >= 2:
                seconds = self._seconds(measured, rows, width + 1)
                line.add(width, seconds)
                average = max(seconds - plain, 0.0) / width
                slope = line.slope
                per_token = max(average if slope is None else slope, average * MATCH_MIN_SLOPE)
                last, last_seconds = width, seconds
            else:
                seconds = last_seconds + per_token * (width - last)
            rates.append(tokens / seconds)
        best = 0
        for width, rate in enumerate(rates):
            if rate > rates[best] * (1 + LOAD_MARGIN):
                best = width
        width = self._width_check(best, widest, probe)
        return width, rates[width]

    def _width_check(self, best: int, widest: int, now: bool) -> int:
        """``best``, or now and then a neighbour of it to measure again (see `match_option`)."""
        if not self._width_checks.tick() and not now:
            return best
        self._width_checks.restart(best)
        self._width_side = -self._width_side
        for width in (best + self._width_side, best - self._width_side):
            if 1 <= width <= widest:
                return width
        return best

    def update_match_width(self, rows: int, width: int, seconds: float) -> None:
        """Record a round without a model draft that verified ``width`` tokens of matches."""
        if ("match", width) not in self._warmed:  # new shapes, cold caches
            self._warmed.add(("match", width))
        else:
            relative = self._relative(rows, width, seconds)
            self.match_times.setdefault(width, RoundTimes()).add(rows, relative)

    def _relative(self, rows: int, k: int, seconds: float) -> float:
        """What a round is kept as: the target alone's (K = 0) in seconds, the others as a
        multiple of the target alone's rounds of late. Rounds grow dearer as the rows grow
        (attention reads the whole cache), and a K not chosen is measured seldom: taken in
        seconds, one measured while the rows were short would look cheap against the target
        alone's rounds now."""
        plain = self.times.get(0)
        return seconds if k == 0 or plain is None else seconds / plain.predict(rows)

    def predicted_seconds(self, rows: int, k: int) -> float:
        return self._seconds(self.times[k], rows, k + 1)

    def _seconds(self, times: RoundTimes, rows: int, width: int) -> float:
        """A round's seconds by ``times`` (rounds verifying ``width`` positions per row), except
        where they were measured on one side of ``rows`` only (a check at a full batch, say):
        then priced from the nearest size measured as the target alone's rounds (K = 0) change
        between the two sizes: shrinking in proportion to them, growing the more of in
        proportion and by ``width`` times their growth. Never cheaper than the evidence says,
        so a K is measured at this size (a check) before it is trusted here."""
        plain, sizes = self.times.get(0), times.by_size
        if plain is None or times is plain:
            return times.predict(rows)
        here = plain.predict(rows)  # ``times`` hold multiples of the target alone's (`_relative`)
        if rows in sizes or min(sizes) < rows < max(sizes):
            return times.predict(rows) * here
        nearest = min(sizes, key=lambda n: abs(n - rows))
        there = plain.predict(nearest)
        measured = times.predict(nearest) * there
        scaled = measured * here / there
        return scaled if rows < nearest else max(scaled, measured + width * (here - there))

    def expected_tokens(self, k: int) -> float:
        """Tokens a row emits per round drafting ``k``: the bonus/correction token plus each
        draft token that survives with all before it."""
        total, survive = 1.0, 1.0
        for i in range(k):
            survive *= self.acceptance(i)
            total += survive
        return total

    def acceptance(self, position: int) -> float:
        prior = 2.0
        if position >= len(self.reached):
            return PRIOR_ACCEPTANCE
        return (self.accepted[position] + prior * PRIOR_ACCEPTANCE) / (
            self.reached[position] + prior
        )

    def charge(self, seconds: float, tokens: int = 0) -> None:
        """Count ``seconds`` spent for the round about to run beyond its own time (the draft
        catching up on ``tokens``) in what the current check costs."""
        self._check_cost += seconds
        if tokens:
            self._catch_up_s = _average(self._catch_up_s, seconds / tokens, 0.5)

    def update(self, rows: int, k: int, seconds: float | None, parts: list, steps: list) -> None:
        """Record a round of ``rows`` rows drafting ``k``: its wall time (None: not a time of
        this K, e.g. matches widened the call), and for each row (``parts[i].k`` drafted,
        ``steps[i].accepted`` kept) which positions were reached."""
        if seconds is not None:
            self._since_seconds += seconds
            if self._checking is not None and self._checking in self.times:
                best = self.predicted_seconds(rows, self._checking)
                self._check_cost += max(0.0, seconds - best)
        self._checking = None
        if seconds is None:
            pass
        elif k not in self._warmed:  # the first round of a K: new shapes, cold caches
            self._warmed.add(k)
        else:
            self.times.setdefault(k, RoundTimes()).add(rows, self._relative(rows, k, seconds))
        if k > len(self.reached):
            grow = k - len(self.reached)
            self.reached += [0.0] * grow
            self.accepted += [0.0] * grow
        if k:  # the text drifts: older rounds weigh less (rounds without drafts tell nothing)
            for i in range(len(self.reached)):
                self.reached[i] *= LOAD_DECAY
                self.accepted[i] *= LOAD_DECAY
        for part, step in zip(parts, steps):
            for i in range(min(step.accepted + 1, part.k)):
                self.reached[i] += 1.0
            for i in range(step.accepted):
                self.accepted[i] += 1.0

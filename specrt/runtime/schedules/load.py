"""The load schedule: one K for a round of rows sharing model calls, and how many tokens of
the rows' matches a round without a model draft verifies, both from what rounds have cost."""

from __future__ import annotations

import numpy as np

from specrt.runtime.schedules.base import computed_positions
from specrt.runtime.schedules.constants import (
    LOAD_CATCH_UP_SMOOTHING,
    LOAD_DECAY,
    LOAD_EXPLORE_SHARE,
    LOAD_MARGIN,
    LOAD_PRIOR_WEIGHT,
    MATCH_MIN_SLOPE,
    MATCH_PRIOR_COST,
    PRIOR_ACCEPTANCE,
)
from specrt.runtime.schedules.estimators import CheckSpacing, LineFit, RoundTimes, moving_average


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
    ``adapt=False``: always the largest K allowed (the "fixed" schedule); ``even_rows``: the
    target's calls compute an even number of positions per row (a quantised target on AVX2)."""

    def __init__(self, adapt: bool = True, even_rows: bool = False) -> None:
        self.adapt = adapt
        self.even_rows = even_rows
        self.times: dict[int, RoundTimes] = {}  # by K
        # by width: rounds without a model draft verifying that many tokens of matches
        self.match_times: dict[int, RoundTimes] = {}
        self._warmed: set[int | tuple[str, int]] = set()
        self.reached: list[float] = []  # per draft position: decayed counts
        self.accepted: list[float] = []
        self._k_checks = CheckSpacing()
        self.last_k: int | None = None  # the K chosen last
        self._turn = 0  # which K a check measures: below the best, above, the target alone
        self._width_checks, self._width_side = CheckSpacing(), 1
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
        measured at the cost of one more position fitted over the measured widths (with one
        measured: its average cost per position; before any, or while the measured ones compute
        no more positions than a round without matches (``even_rows``: 1 token of matches and
        the newest one are the 2 positions a round without them computes): `MATCH_PRIOR_COST`
        of a round without matches), so widths are tried one after another while they pay. A
        width is kept as long as it is the best; a neighbour of it is measured again as K's are
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
        # more position fitted over the measured widths (the first token of a match costs more
        # than the ones after it: a line from the round without matches overprices them).
        line = LineFit(0.0)
        last, last_seconds, per_position = 0, plain, MATCH_PRIOR_COST * plain
        # the tokens of every width: a row's curve stays at its end past its match's length
        padded = [c + c[-1:] * (widest - len(c)) for c in curves]
        tokens_by_width = (rows - len(curves) + np.sum(padded, axis=0)).tolist() if curves else []
        for width, tokens in enumerate(tokens_by_width, 1):
            measured = self.match_times.get(width)
            extra = self._extra_positions(width)
            if measured is not None and len(measured) >= 2:
                seconds = self._seconds(measured, rows, width + 1)
                line.add(extra, seconds)
                if extra:  # else it tells nothing of what a position costs
                    average = max(seconds - plain, 0.0) / extra
                    slope = line.slope
                    per_position = max(
                        average if slope is None else slope, average * MATCH_MIN_SLOPE
                    )
                last, last_seconds = extra, seconds
            else:
                seconds = last_seconds + per_position * (extra - last)
            rates.append(tokens / seconds)
        best = 0
        for width, rate in enumerate(rates):
            if rate > rates[best] * (1 + LOAD_MARGIN):
                best = width
        width = self._width_check(best, widest, probe)
        return width, rates[width]

    def _extra_positions(self, width: int) -> int:
        """The positions per row a round verifying ``width`` tokens of matches computes beyond
        a round without them."""
        plain = computed_positions(1, self.even_rows)
        return computed_positions(width + 1, self.even_rows) - plain

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
        prior = LOAD_PRIOR_WEIGHT
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
            self._catch_up_s = moving_average(
                self._catch_up_s, seconds / tokens, LOAD_CATCH_UP_SMOOTHING
            )

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

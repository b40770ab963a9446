"""Draft-length schedules; the adaptive one drafts on while one more token pays for its time."""

from __future__ import annotations

import random

import pytest

from specrt.errors import InvalidInputError
from specrt.runtime import GenerationConfig
from specrt.runtime.schedules import AdaptiveSchedule, FixedSchedule, HeuristicSchedule, LineFit


class Clock:
    """Simulated time: each draft step advances it by its cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def controller_with_clock(k_max=8):
    clock = Clock()
    return AdaptiveSchedule(k_max, clock=clock), clock


def feed(
    controller, rounds, confidence, accepted_of, draft_s=1.0, verify_s=5.0, per_token=0.1,
    even_rows=False,
):  # fmt: skip
    """Run ``rounds`` simulated rounds the way the generator and drafter call the controller;
    return how many tokens each round drafted (``even_rows``: a verification of an odd number
    of positions costs what the next even number does)."""
    clock = getattr(controller, "clock", None)
    drafted_per_round = []
    for _ in range(rounds):
        limit = controller.start_round(controller.k_max)
        confidences = []
        while len(confidences) < limit:
            confidences.append(confidence())
            if isinstance(clock, Clock):
                clock.now += draft_s
            keep_going = controller.keep_drafting
            if keep_going is not None and not keep_going(len(confidences), confidences[-1]):
                break
        k = len(confidences)
        drafted_per_round.append(k)
        accepted = accepted_of(confidences)
        fed = k + 1 + (k + 1) % 2 if even_rows else k + 1
        controller.update(k, accepted, draft_s * k, verify_s + per_token * (fed - 1))
    return drafted_per_round


def leading(accept):
    """accepted_of: count the leading tokens for which accept(confidence) is true."""

    def accepted_of(confidences):
        n = 0
        while n < len(confidences) and accept(confidences[n]):
            n += 1
        return n

    return accepted_of


def test_always_accepted_cheap_draft_drafts_to_the_limit():
    controller = controller_with_clock(8)[0]
    chosen = feed(controller, 40, lambda: 0.95, leading(lambda c: True), draft_s=0.1)
    assert chosen[-10:] == [8] * 10


def test_never_accepted_stops_drafting_then_retries():
    controller = controller_with_clock(8)[0]
    feed(controller, 60, lambda: 0.5, leading(lambda c: False))
    # Mostly target-only rounds; with no drafting there is no evidence, so the estimate drifts
    # back and a one-token draft is retried now and then (in case the text became easier).
    later = feed(controller, 80, lambda: 0.5, leading(lambda c: False))
    assert later.count(0) >= 0.75 * len(later) and set(later) == {0, 1}


def test_expensive_draft_drafts_shorter():
    """Same texts and acceptance; a draft step costing 2% of a verification drafts longer than
    one costing 40%."""
    rng = random.Random(1)

    def confidence():
        return rng.random()

    accepted = leading(lambda c: rng.random() < 0.3 + 0.7 * c)
    cheap = feed(controller_with_clock(8)[0], 300, confidence, accepted, draft_s=0.1)
    dear = feed(controller_with_clock(8)[0], 300, confidence, accepted, draft_s=2.0)
    assert sum(cheap[-100:]) > 1.5 * sum(dear[-100:]) > 0


def test_a_first_round_s_slow_step_does_not_hold_the_step_cost_up():
    """A round's first draft step runs on cold caches (an EAGLE head also reads the round's
    tokens there): a round of one step does not price the step, and the first step timed
    between two tokens does, in place of the first rounds' average (a moving average from
    it kept most of a 5x first step for tens of rounds)."""
    controller, clock = controller_with_clock(4)
    assert controller.start_round(4) == 4
    clock.now += 5.0  # the first step: 5x a step
    assert not controller.keep_drafting(1, 0.9)  # the measuring rounds vary K: 1 here
    controller.update(1, 1, 5.0, 5.0)
    assert controller.draft_step_s is None and controller.threshold is None
    assert controller.start_round(4) == 4
    clock.now += 5.0
    assert controller.keep_drafting(1, 0.9)
    clock.now += 1.0  # a step between two tokens
    assert not controller.keep_drafting(2, 0.9)
    controller.update(2, 2, 6.0, 5.2)
    assert controller.draft_step_s == pytest.approx(1.0)


def test_stops_at_unconfident_tokens():
    """When low-confidence tokens are always rejected and confident ones accepted, the controller
    learns to stop right after an unconfident token and to go on after confident ones."""
    rng = random.Random(2)
    controller = controller_with_clock(8)[0]
    feed(controller, 400, lambda: rng.choice([0.05, 0.95]), leading(lambda c: c > 0.5), 0.5)
    assert controller.acceptance(0.95) > 0.9 and controller.acceptance(0.05) < 0.1
    assert controller.start_round(8) == 8
    assert controller.keep_drafting(1, 0.95)
    assert controller.keep_drafting(2, 0.95)
    assert not controller.keep_drafting(3, 0.05)


def test_a_target_of_even_rows_drafts_on_where_the_verification_is_paid_anyway():
    """A target whose calls compute an even number of positions verifies an even K (K + 1
    positions, odd) at the cost of one more token: the schedule that knows it drafts that
    token for a draft step's price, so its rounds end at odd K, where one that does not know it
    ends as often at even K."""

    def run(even_rows):
        rng = random.Random(3)
        controller = AdaptiveSchedule(6, clock=Clock(), even_rows=even_rows)
        accepted = leading(lambda c: rng.random() < 0.6)
        chosen = feed(
            controller, 600, lambda: 0.6, accepted, draft_s=0.3, per_token=1.0, even_rows=True
        )
        between = [k for k in chosen[-300:] if 0 < k < 6]
        return sum(k % 2 for k in between) / len(between)

    assert run(even_rows=True) > 0.95
    assert run(even_rows=False) < 0.5


def test_line_fit_slope():
    fit = LineFit(smoothing=0.1)
    assert fit.slope is None
    for x in [1, 3, 2, 5, 4] * 5:
        fit.add(x, 2.0 + 0.5 * x)
    assert abs(fit.slope - 0.5) < 1e-9 and len(fit) == 25


def test_heuristic_schedule_is_plus_two_minus_one():
    controller = HeuristicSchedule(k_max=8)
    chosen = feed(controller, 5, lambda: 0.9, leading(lambda c: True))
    assert chosen == [4, 6, 8, 8, 8]
    assert feed(controller, 3, lambda: 0.9, leading(lambda c: False)) == [8, 7, 6]


def test_fixed_schedule_drafts_k_where_it_fits():
    schedule = FixedSchedule(4)
    assert schedule.keep_drafting is None
    assert feed(schedule, 3, lambda: 0.9, leading(lambda c: False)) == [4, 4, 4]
    assert schedule.start_round(2) == 2


def test_schedule_names():
    with pytest.warns(DeprecationWarning, match="adaptive_draft=True.* is deprecated"):
        assert GenerationConfig(adaptive_draft=True).draft_schedule == "adaptive"
    assert GenerationConfig(draft_schedule="heuristic").draft_schedule == "heuristic"
    with pytest.raises(InvalidInputError, match="draft_schedule='sometimes' is out of range"):
        GenerationConfig(draft_schedule="sometimes")

"""The adaptive draft-length controller picks K from acceptance and measured costs."""

from __future__ import annotations

import random

from specrt.runtime.draft_length import DraftLengthController


def feed(controller, rounds, accepted_of, draft_s=1.0, verify_s=5.0):
    chosen = []
    for _ in range(rounds):
        k = controller.choose()
        chosen.append(k)
        controller.update(k, accepted_of(k), draft_s * k, verify_s)
    return chosen


def test_always_accepted_cheap_draft_drafts_long():
    controller = DraftLengthController(k_max=8)
    chosen = feed(controller, 30, accepted_of=lambda k: k, draft_s=0.1)
    assert chosen[-1] == 8


def test_never_accepted_stops_drafting_then_retries():
    controller = DraftLengthController(k_max=8)
    chosen = feed(controller, 12, accepted_of=lambda k: 0)
    assert chosen[-1] == 0
    # with no drafting there is no evidence: the estimate drifts back and drafting is retried
    assert any(k > 0 for k in feed(controller, 40, accepted_of=lambda k: 0)[5:])


def leading_successes(probability, seed):
    rng = random.Random(seed)

    def accepted_of(k):
        n = 0
        while n < k and rng.random() < probability:
            n += 1
        return n

    return accepted_of


def test_expensive_draft_drafts_shorter():
    """Acceptance 0.7 per position: a draft costing 1% of the target drafts long, one costing
    40% drafts one or two tokens (the argmax of E(K)/T(K))."""
    cheap = feed(DraftLengthController(8), 60, leading_successes(0.7, 1), draft_s=0.05)
    dear = feed(DraftLengthController(8), 60, leading_successes(0.7, 1), draft_s=2.0)
    assert sum(cheap[-20:]) / 20 >= 5
    assert 1 <= sum(dear[-20:]) / 20 <= 2.5

"""Never slower than the target alone: the adaptive schedule's guard (`SpeculationGuard`) keeps a
kind of speculation (the draft model's rounds, verified matches) only while its rounds, timed
as a whole, beat plain ones, and probes a loser rarely. Its rules on simulated timings; then real
poor drafts built here (the target's first layer untrained; an unrelated random model) under
the default configuration. How fast that decodes is the benchmarks' to say (`bench/real.py`);
what is asserted is what the guard does and that the output stays the target's."""

from __future__ import annotations

import pytest

from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.schedules.constants import (
    GUARD_COPY_SPACING,
    GUARD_EMPTY_LOSS,
    GUARD_EMPTY_ROUNDS,
    GUARD_FIRST_ROUNDS,
    GUARD_FIRST_WAIT,
    GUARD_MATCH_ON_MARGIN,
    GUARD_MATCH_RAMP,
    GUARD_MAX_WAIT,
    GUARD_PLAIN_EVERY,
    GUARD_PROBE_BUDGET,
    GUARD_PROBE_MATCH,
    GUARD_ROW_PROBE,
)
from specrt.runtime.schedules.guard import MATCH, MODEL, PLAIN, UNCAPPED, SpeculationGuard

PLAIN_S = 0.02  # a plain round: one token in 20 ms


def simulate(guard: SpeculationGuard, rounds: int, tokens_per_s: dict[str, float]) -> list:
    """Rounds as the lone planner runs them: the model drafts where allowed, else a match is
    verified where allowed, else a plain round; each kind emits its ``tokens_per_s`` (a share of
    plain rounds' rate). Returns each round's (kind, cap)."""
    log = []
    for _ in range(rounds):
        model_cap, match_cap = guard.caps()
        kind, cap = (
            (MODEL, model_cap) if model_cap else (MATCH, match_cap) if match_cap else (PLAIN, 0)
        )
        ratio = tokens_per_s.get(kind, 1.0)
        guard.observe(
            kind, 2 if kind != PLAIN else 1, (2 if kind != PLAIN else 1) * PLAIN_S / ratio
        )
        log.append((kind, cap))
    return log


def test_a_kind_that_loses_is_switched_off_and_probed_ever_more_rarely():
    guard = SpeculationGuard()
    log = simulate(guard, 400, {MODEL: 0.8, MATCH: 0.9})
    kinds = [kind for kind, _ in log]
    # Each kind is probed with a capped round first, then judged against plain rounds
    assert log[0] == (MODEL, UNCAPPED)
    assert kinds[:GUARD_FIRST_ROUNDS] == [MODEL] * GUARD_FIRST_ROUNDS
    assert PLAIN in kinds[GUARD_FIRST_ROUNDS : GUARD_FIRST_ROUNDS + 3]
    assert "on" not in (guard.kinds[MODEL].state, guard.kinds[MATCH].state)
    # Probes (of matches, short ones) at waits that double: most rounds are plain
    assert {cap for kind, cap in log if kind == MATCH} == {GUARD_PROBE_MATCH}
    starts = [i for i in range(1, len(kinds)) if kinds[i] == MODEL and kinds[i - 1] != MODEL]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 4 * GUARD_FIRST_WAIT, gaps
    assert kinds[100:].count(PLAIN) > 0.9 * len(kinds[100:])


def test_a_kind_that_pays_stays_on_uncapped_with_a_plain_round_now_and_then():
    guard = SpeculationGuard()
    log = simulate(guard, 200, {MODEL: 1.5})
    assert guard.kinds[MODEL].state == "on"
    later = log[20:]
    assert (MODEL, UNCAPPED) in later
    plain = [i for i, (kind, _) in enumerate(later) if kind == PLAIN]
    assert plain and max(b - a for a, b in zip(plain, plain[1:])) <= GUARD_PLAIN_EVERY + 1


def test_matches_stay_where_the_model_loses():
    guard = SpeculationGuard()
    log = simulate(guard, 200, {MODEL: 0.7, MATCH: 2.0})
    assert guard.kinds[MATCH].state == "on" and guard.kinds[MODEL].state == "off"
    assert [kind for kind, _ in log[100:]].count(MATCH) > 0.8 * 100
    assert (MATCH, GUARD_PROBE_MATCH) in log and (MATCH, UNCAPPED) in log


def test_one_plain_round_the_machine_slowed_does_not_turn_a_losing_draft_on():
    """The first plain rounds are the baseline a probe is judged by: one taking three times
    as long (another process on the cores) must not make a draft at 0.8x plain rounds look
    like a gain, which would keep it on until the next plain round."""
    guard = SpeculationGuard()
    plain_times = iter([3 * PLAIN_S] + [PLAIN_S] * 100)
    kinds = []
    for _ in range(60):
        kind = MODEL if guard.caps()[0] else PLAIN
        seconds = 2 * PLAIN_S / 0.8 if kind == MODEL else next(plain_times)
        guard.observe(kind, 2 if kind == MODEL else 1, seconds)
        kinds.append(kind)
    assert kinds[:GUARD_FIRST_ROUNDS] == [MODEL] * GUARD_FIRST_ROUNDS
    assert MODEL not in kinds[GUARD_FIRST_ROUNDS : GUARD_FIRST_ROUNDS + GUARD_FIRST_WAIT + 3]
    assert kinds.count(MODEL) <= 3 * GUARD_FIRST_ROUNDS, kinds


def test_a_new_row_probes_a_kind_that_is_off_early():
    guard = SpeculationGuard()
    simulate(guard, 60, {MODEL: 0.8, MATCH: 0.8})
    guard.kinds[MODEL].wait = guard.kinds[MATCH].wait = 1000  # no probe due by waiting
    guard.new_row()
    log = simulate(guard, 10, {MODEL: 0.8, MATCH: 0.8})
    assert log[GUARD_ROW_PROBE][0] == MODEL
    guard.new_row()
    log = simulate(guard, 10, {MODEL: 1.6, MATCH: 0.8})  # this row's text suits the draft
    assert guard.kinds[MODEL].state == "on"


def test_a_costly_probe_that_lost_waits_until_it_is_paid_for_and_a_row_probes_once():
    """A draft catching up on a fast target: its probe round costs 6 plain rounds. The next
    probe waits until that loss is `GUARD_PROBE_BUDGET` of the rounds in between, and a row
    that began with the probe is not probed again at its `GUARD_ROW_PROBE`th round."""
    guard = SpeculationGuard()
    guard.new_row()  # the row starts with the first probe
    log = []
    for _ in range(40):
        model_cap, _ = guard.caps()
        kind = MODEL if model_cap else PLAIN
        guard.observe(kind, 1, (6 if kind == MODEL else 1) * PLAIN_S)  # keeps nothing
        log.append(kind)
    assert log[:GUARD_EMPTY_ROUNDS] == [MODEL] * GUARD_EMPTY_ROUNDS, log
    assert log[GUARD_EMPTY_ROUNDS:].count(MODEL) == 0, log
    lost = GUARD_EMPTY_ROUNDS * (6 - 1)  # plain rounds' worth: rounds of 6 for 1 token each
    assert guard.kinds[MODEL].wait >= min(GUARD_MAX_WAIT, lost / GUARD_PROBE_BUDGET * 0.9)


def test_a_cheap_empty_start_does_not_end_a_model_probe_a_costly_one_does():
    """A draft that keeps half its first tokens starts a probe with nothing kept half the time:
    a start that lost under `GUARD_EMPTY_LOSS` plain rounds goes on to the probe's end."""
    cheap = 1 + 0.6 * GUARD_EMPTY_LOSS  # plain rounds' worth of one empty round
    guard = SpeculationGuard()
    guard.plain.extend([PLAIN_S] * 4)
    assert guard.caps()[0] == UNCAPPED
    guard.observe(MODEL, 1, cheap * PLAIN_S)  # kept nothing, lost 0.6 of a plain round
    assert guard.caps()[0] == UNCAPPED and guard.kinds[MODEL].state == "probe"
    for _ in range(GUARD_FIRST_ROUNDS - 1):  # then keeps two tokens a round for 1.4 rounds
        guard.observe(MODEL, 3, 1.4 * PLAIN_S)
        guard.caps()
    assert guard.kinds[MODEL].state == "on"
    # Two such empty rounds lose a plain round's worth: that ends a probe
    guard = SpeculationGuard()
    guard.plain.extend([PLAIN_S] * 4)
    for _ in range(2):
        assert guard.caps()[0] == UNCAPPED
        guard.observe(MODEL, 1, cheap * PLAIN_S)
    assert guard.caps() == (0, GUARD_PROBE_MATCH) and guard.kinds[MODEL].state == "off"


def test_a_probe_that_keeps_nothing_ends_early_and_a_copy_is_probed_soon():
    guard = SpeculationGuard()
    guard.plain.extend([PLAIN_S] * 4)
    guard.kinds[MODEL].state = "off"
    guard.kinds[MODEL].wait = 1000
    for _ in range(GUARD_EMPTY_ROUNDS):  # match rounds keeping nothing: judged at once, a loss
        assert guard.caps() == (0, GUARD_PROBE_MATCH)
        guard.observe(MATCH, 1, 1.1 * PLAIN_S)
    assert guard.caps() == (0, 0) and guard.kinds[MATCH].state == "off"
    # A row that starts copying itself may have its matches probed, spaced out
    assert not guard.copy_probe()
    for _ in range(GUARD_COPY_SPACING):
        guard.observe(PLAIN, 1, PLAIN_S)
    assert guard.copy_probe() and guard.caps() == (0, GUARD_PROBE_MATCH)
    guard.observe(MATCH, 1 + GUARD_PROBE_MATCH, 1.2 * PLAIN_S)  # copies pay at once
    guard.observe(MATCH, 1 + GUARD_PROBE_MATCH, 1.2 * PLAIN_S)
    assert guard.kinds[MATCH].state == "probe"  # (kept some: the probe runs its length)


def test_one_lucky_match_does_not_turn_matches_on_a_copy_does():
    """A probe of matches verifies one token a round: one kept in its first six rounds looks
    like 1.1x plain rounds, and the rounds after it, verifying whole matches, kept nothing on
    SmolLM2's chat answers. Matches turn on only where the probe beats plain rounds by
    `GUARD_MATCH_ON_MARGIN`, as a row copying itself does (its token kept every round)."""
    lucky, copy = [1] + [0] * (GUARD_FIRST_ROUNDS - 1), [1] * GUARD_FIRST_ROUNDS
    for kept, state in ((lucky, "off"), (copy, "on")):
        guard = SpeculationGuard()
        guard.plain.extend([PLAIN_S] * 4)
        guard.kinds[MODEL].state, guard.kinds[MODEL].wait = "off", 1000
        for extra in kept:
            assert guard.caps() == (0, GUARD_PROBE_MATCH)
            guard.observe(MATCH, 1 + extra, 1.05 * PLAIN_S)
        guard.caps()
        ratio = (sum(kept) + len(kept)) / (1.05 * len(kept))  # over plain rounds: above 1
        assert 1 < ratio and (ratio >= 1 + GUARD_MATCH_ON_MARGIN) == (state == "on")
        assert guard.kinds[MATCH].state == state, kept


def test_matches_turned_on_again_after_a_loss_verify_a_few_tokens_first_then_double():
    """A probe of one-token rounds can keep two tokens by luck on text that never copies;
    verifying a whole match right after it cost SmolLM2's int4 target 2.7 plain rounds for
    nothing. Matches judged a loss before and turned on again verify `GUARD_MATCH_RAMP` tokens
    at most, twice as many after each round that keeps them all; a first probe that wins
    turns them on uncapped."""
    copy = [1] * GUARD_FIRST_ROUNDS  # every probe round keeps its token
    guard = SpeculationGuard()
    guard.plain.extend([PLAIN_S] * 4)
    guard.kinds[MODEL].state, guard.kinds[MODEL].wait = "off", 1000
    for extra in copy:
        guard.caps()
        guard.observe(MATCH, 1 + extra, 1.05 * PLAIN_S)
    assert guard.caps() == (0, UNCAPPED)  # never judged a loss: the whole match
    for _ in range(40):  # then the text stops copying: a loss, off
        guard.observe(MATCH, 1, 1.5 * PLAIN_S)
        if guard.kinds[MATCH].state == "off":
            break
    assert guard.kinds[MATCH].state == "off"
    guard.kinds[MATCH].start_probe()
    while guard.probing(MATCH):  # a probe that wins again: its token kept every round
        assert guard.caps() == (0, GUARD_PROBE_MATCH)
        guard.observe(MATCH, 2, 1.05 * PLAIN_S)
    caps = []
    for kept in (GUARD_MATCH_RAMP, 1, 2 * GUARD_MATCH_RAMP):  # all, a part, all
        caps.append(guard.caps()[1])
        guard.observe(MATCH, 1 + kept, 1.05 * PLAIN_S)
    caps.append(guard.caps()[1])
    ramp = GUARD_MATCH_RAMP
    assert caps == [ramp, 2 * ramp, 2 * ramp, 4 * ramp]


def test_a_probe_of_matches_runs_where_the_whole_match_would_beat_the_model():
    """The hybrid weighs a match under probe by all of it, and verifies only the probe's
    tokens: weighed by a probe of one token, a match never beats a model whose rounds keep a
    few, so matches were never measured again (the demo pair's answers, whose matches pay
    most, lost them so)."""
    from specrt.runtime.hybrid import HybridChoice
    from specrt.runtime.lookup import NgramIndex
    from specrt.runtime.planning import LonePlanner
    from specrt.runtime.requests import LoneLearners, Request, Row
    from specrt.runtime.results import GenerationStats
    from specrt.runtime.schedules import make_schedule

    config = GenerationConfig()  # the hybrid, adaptive: the guard's settings
    tokens = [5, 6, 7, 8, 9, 10, 11] * 5  # the row repeats itself: a long match
    hybrid = HybridChoice()
    hybrid._model_rounds, hybrid._model_tokens, hybrid._model_passes = 100, 250.0, 100.0
    guard = SpeculationGuard()
    guard.plain.extend([PLAIN_S] * 4)
    guard.kinds[MODEL].state = "on"
    assert guard.caps() == (UNCAPPED, GUARD_PROBE_MATCH) and guard.probing(MATCH)

    def plan() -> list[int] | None:
        request = Request(0, tokens, config)
        stats = GenerationStats(prompt_tokens=len(tokens))
        row = Row(request, list(tokens), len(tokens) + 50, True, stats, 0.0)
        row.index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
        schedule = make_schedule(config.draft_schedule, config.num_draft_tokens)
        LonePlanner(None).plan(row, 24, LoneLearners(hybrid, schedule, guard))
        return row.round.match

    assert plan() == [5] * GUARD_PROBE_MATCH  # the next of the loop, no more than the probe's
    guard.kinds[MATCH].state = "on"  # judged a gain: the whole match
    assert len(plan()) > 8


@pytest.fixture(scope="module")
def poor_bundles(tmp_path_factory):
    """A tiny Llama target with two drafts that do not pay: its own first layer, untrained (the
    cut `specrt distill` starts from), and an unrelated random model of its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specrt.distill.draft import truncated
    from specrt.export import export_bundle
    from specrt.export.tiny import make_tiny_pair

    root = tmp_path_factory.mktemp("poor")
    target, unrelated = make_tiny_pair(
        "llama", root / "pair", seed=3, draft_dims={"layers": 1, "hidden": 32}
    )
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    cut = root / "cut"
    truncated(model, 1).save_pretrained(cut)
    AutoTokenizer.from_pretrained(target).save_pretrained(cut)
    bundles = {}
    for name, draft in (("cut", cut), ("unrelated", unrelated)):
        export_bundle(target, draft, root / f"{name}-bundle")
        bundles[name] = root / f"{name}-bundle"
    return bundles


@pytest.mark.parametrize("draft", ["cut", "unrelated"])
def test_a_poor_draft_is_noticed_and_the_output_stays_the_targets(poor_bundles, draft):
    generator = SpeculativeGenerator.from_bundle(poor_bundles[draft], threads=1)
    prompts = [[1, 5, 9, 12, 20, 7, 30], [4, 8, 15, 16, 23, 42], [2, 3, 5, 7, 11, 13, 17, 19]]
    settings = dict(max_new_tokens=96, ignore_eos=True)
    alone = [
        r.token_ids
        for r in generator.generate(prompts, GenerationConfig(num_draft_tokens=0, **settings))
    ]
    # The drafts do not pay: drafting every round keeps few of their tokens
    fixed = GenerationConfig(proposer="model", draft_schedule="fixed", **settings)
    results = generator.generate(prompts, fixed)
    assert [r.token_ids for r in results] == alone
    drafted = sum(r.stats.drafted_tokens for r in results)
    assert sum(r.stats.accepted_tokens for r in results) < 0.5 * drafted
    # The default: one request after another on one generator, as a service runs them. The
    # guard judges measured round times, and a round of this tiny pair takes a fraction of a
    # millisecond, which the other test worker on the same cores can double now and then: up
    # to 3 attempts, each learning afresh (a guard that does not notice fails every one).
    default = GenerationConfig(**settings)
    assert default.proposer == "hybrid" and default.draft_schedule == "adaptive"
    for _ in range(3):
        generator.forget_learning()
        results = [generator.generate([prompt], default)[0] for prompt in prompts]
        assert [r.token_ids for r in results] == alone
        rounds = sum(r.stats.rounds for r in results)
        model_rounds = sum(r.stats.proposers.get("model", {}).get("rounds", 0) for r in results)
        if model_rounds <= 0.15 * rounds:
            break
    assert model_rounds <= 0.15 * rounds, (model_rounds, rounds)
    guard = generator.one_row(default).guard
    assert guard is not None and guard.kinds[MODEL].state != "on"
    generator.forget_learning()  # (what `--compare` does after its warm-up)
    assert generator.one_row(default).guard.kinds[MODEL].state == "probe"


def test_a_probe_is_judged_on_its_rounds_once_caught_up_and_pays_for_catching_up():
    """An EAGLE head reads the whole prompt before its first draft (5 plain rounds' worth on
    the demo target) and then beats plain rounds by a third: it is turned on, where timing the
    catch-up into the probe's six rounds judged it a loss for the rest of the row. A head that
    loses anyway after reading what it missed while off waits for that too: its next probe
    reads again what it misses. The row's prompt is read once a row: it sets no wait."""

    def probe(ratio: float, catch_up: float, read_row: bool = True) -> SpeculationGuard:
        guard = SpeculationGuard()
        guard.new_row()
        guard.plain.extend([PLAIN_S] * 4)
        guard.kinds[MODEL].read_row = read_row  # True: a probe after rounds it was off
        for round_ in range(GUARD_FIRST_ROUNDS):
            assert guard.caps()[0] == UNCAPPED
            extra = catch_up * PLAIN_S if round_ == 0 else 0.0
            guard.observe(MODEL, 2, 2 * PLAIN_S / ratio + extra, extra)
        guard.caps()
        return guard

    assert probe(1.33, catch_up=5).kinds[MODEL].state == "on"
    assert probe(1.33, catch_up=5, read_row=False).kinds[MODEL].state == "on"
    without, costly = probe(0.9, catch_up=0).kinds[MODEL], probe(0.9, catch_up=5).kinds[MODEL]
    prompt = probe(0.9, catch_up=5, read_row=False).kinds[MODEL]
    assert without.state == costly.state == prompt.state == "off"
    assert costly.wait >= min(GUARD_MAX_WAIT, 5 / GUARD_PROBE_BUDGET) > without.wait
    assert prompt.wait == without.wait


def test_a_head_whose_first_draft_is_rejected_after_reading_a_long_prompt_goes_on():
    """A fresh request: the head reads the prompt (5 plain rounds' worth), drafts one token,
    and the target rejects it; the round itself cost half a plain round more than a plain one.
    That says little (a head keeping 0.65 of its tokens starts so a third of the time): the
    probe goes on. Counting the prompt in its loss held the head off for the whole request."""
    guard = SpeculationGuard()
    guard.new_row()
    guard.plain.extend([PLAIN_S] * 4)
    assert guard.caps()[0] == UNCAPPED
    catch_up = 5 * PLAIN_S
    guard.observe(MODEL, 1, 1.5 * PLAIN_S + catch_up, catch_up)
    assert guard.caps()[0] == UNCAPPED
    assert guard.kinds[MODEL].state == "probe"
    # The same start after rounds off, reading what it missed: as costly as it looks (its
    # next probe reads as much again), and it ends the probe
    guard = SpeculationGuard()
    guard.new_row()
    guard.plain.extend([PLAIN_S] * 4)
    guard.kinds[MODEL].read_row = True
    guard.caps()
    guard.observe(MODEL, 1, 1.5 * PLAIN_S + catch_up, catch_up)
    assert guard.caps()[0] == 0
    assert guard.kinds[MODEL].state == "off"

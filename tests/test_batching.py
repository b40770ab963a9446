"""Batched generation: rows of different lengths share every model call, accept different numbers
of draft tokens, finish at different rounds and are replaced by waiting rows; each row's output
is what it would be alone."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import specrt.runtime.planning as planning
from specrt.backends.select import ONE_ROW_PORTABLE
from specrt.errors import InvalidInputError, NumericalError
from specrt.export import ENGINE_MODEL_TYPES
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.batching import BatchRunner, Request
from specrt.runtime.generator import row_rng
from specrt.runtime.prefixes import KeptRows
from tests.conftest import log_softmax_after
from tests.test_greedy import PROMPTS


def requests(generator, configs):
    """One request per prompt, each with its own config (and own stream, keyed by its index)."""
    prompts = generator.encode_prompts(PROMPTS)
    return [
        Request(i, ids, config, np.random.default_rng([config.seed or 0, i]))
        for i, (ids, config) in enumerate(zip(prompts, configs))
    ]


def run_all(generator, configs) -> dict:
    results = dict(generator.run(requests(generator, configs)))
    assert sorted(results) == list(range(len(configs)))  # every row once
    return results


def varied(k: int, schedule: str = "fixed", **options) -> list[GenerationConfig]:
    """Different max_new_tokens per row, so rows finish at different rounds."""
    return [
        GenerationConfig(
            max_new_tokens=5 + (7 * i) % 29, num_draft_tokens=k, draft_schedule=schedule, **options
        )
        for i in range(len(PROMPTS))
    ]


@pytest.fixture(scope="module")
def alone(bundles):
    """Target-only greedy decoding, one row at a time: what every batched row must equal. The
    random tiny models seldom emit their EOS, so a token about half the rows emit stands in for
    it: rows then stop at EOS at different rounds, others run to their length."""
    out = {}
    for arch in ENGINE_MODEL_TYPES:
        generator = SpeculativeGenerator.from_bundle(bundles[arch], threads=1)
        out[arch, True] = run_all(generator, varied(0, ignore_eos=True))
        rows = [set(r.token_ids) for r in out[arch, True].values()]
        # A token some rows emit and others do not: both kinds of finish happen.
        tokens = set().union(*rows)
        eos = min(tokens, key=lambda t: abs(sum(t in row for row in rows) - len(rows) / 2))
        out[arch, "eos"] = frozenset([eos])
        generator.eos_token_ids = out[arch, "eos"]
        out[arch, False] = run_all(generator, varied(0, ignore_eos=False))
    return out


@pytest.mark.parametrize("engine", ["onnxruntime", "portable"])
@pytest.mark.parametrize("arch", ENGINE_MODEL_TYPES)
def test_batched_greedy_equals_target_alone(bundles, alone, arch, engine):
    # 20 prompts: rows are refilled as others finish. The portable graph pads every batch
    # size alike (mask and positions), so one size checks it.
    for batch in (2, 4, 8) if engine == "onnxruntime" else (4,):
        generator = SpeculativeGenerator.from_bundle(
            bundles[arch], threads=1, max_batch=batch, engine=engine
        )
        one_row = engine == "portable" and arch in ONE_ROW_PORTABLE
        assert generator.max_batch == (1 if one_row else batch)
        generator.eos_token_ids = alone[arch, "eos"]
        for ignore_eos in (False, True):
            expected = alone[arch, ignore_eos]
            for k, schedule in ((0, "fixed"), (1, "fixed"), (4, "fixed"), (4, "adaptive")):
                results = run_all(generator, varied(k, schedule, ignore_eos=ignore_eos))
                for key, result in results.items():
                    assert result.token_ids == expected[key].token_ids, (batch, k, key)
                    assert result.finish_reason == expected[key].finish_reason
                    assert result.text == expected[key].text
                if k and schedule == "fixed":
                    drafted = sum(r.stats.drafted_tokens for r in results.values())
                    accepted = sum(r.stats.accepted_tokens for r in results.values())
                    assert 0 < accepted < drafted, (batch, k)  # ragged acceptance happened
                    # Some row accepted all its draft tokens (the draft then catches up on two).
                    assert any(r.stats.accepted_per_position[-1] for r in results.values())
        # Rows that stop at EOS and rows that run to their length were both in the batches.
        assert {r.finish_reason for r in alone[arch, False].values()} == {"stop", "length"}


def test_generate_keeps_the_order_of_the_prompts(llama_bundle):
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    config = GenerationConfig(max_new_tokens=12, num_draft_tokens=3)
    batched = generator.generate(PROMPTS, config)
    alone = SpeculativeGenerator.from_bundle(llama_bundle, threads=1).generate(PROMPTS, config)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]


@pytest.mark.parametrize("schedule", ["fixed", "adaptive", "heuristic"])
@pytest.mark.parametrize("proposer", ["model", "lookup", "hybrid"])
def test_a_seeded_row_is_the_target_alones_whatever_shares_its_batch(
    llama_bundle, proposer, schedule
):
    """A seeded row draws by position (`KeyedDraws`): its tokens are those the target alone
    samples under its seed, whatever the batch size, its neighbours (other prompts, other
    settings, greedy rows, rows finishing early), its proposer and its draft schedule (batch 1
    is the one-row loop)."""
    seeded = GenerationConfig(
        max_new_tokens=24,
        temperature=1.0,
        num_draft_tokens=3,
        seed=7,
        proposer=proposer,
        draft_schedule=schedule,
    )
    neighbours = [
        GenerationConfig(max_new_tokens=3 + i, temperature=0.6 + 0.1 * i, top_k=5 * i, seed=i)
        for i in range(4)
    ] + [GenerationConfig(max_new_tokens=9, num_draft_tokens=2)]
    mine_keys = (("mine", 0), ("mine", 5))
    target_alone = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    ids = target_alone.encode_prompts(PROMPTS)
    alone = replace(seeded, num_draft_tokens=0, proposer="model")
    expected = {}
    for i in (0, 5):  # the same stream as the row below: (7, i)
        [(_, result)] = target_alone.run([Request(i, ids[i], alone, np.random.default_rng([7, i]))])
        expected[("mine", i)] = result.token_ids
    assert expected[("mine", 0)] != expected[("mine", 5)]
    drafted = accepted = 0
    for batch, order in ((1, 0), (3, 1), (8, 2)):
        generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=batch)
        mine = [Request(("mine", i), ids[i], seeded, np.random.default_rng([7, i])) for i in (0, 5)]
        others = [
            Request(("other", j), ids[(j * 3 + order) % len(ids)], config, np.random.default_rng(j))
            for j, config in enumerate(neighbours)
        ]
        mixed = others[order:] + mine[:1] + others[:order] + mine[1:]
        results = dict(generator.run(mixed))
        assert {key: results[key].token_ids for key in mine_keys} == expected, batch
        drafted += sum(results[key].stats.drafted_tokens for key in mine_keys)
        accepted += sum(results[key].stats.accepted_tokens for key in mine_keys)
        sources = {s for key in mine_keys for s in results[key].stats.proposers}
        assert proposer != "lookup" or "lookup" in sources  # the matches fired
    assert 0 < accepted < drafted  # drafts were kept and drafts were refused


def test_a_draft_equal_to_the_target_is_always_kept_under_a_seed(tmp_path_factory):
    """A float32 draft with the target's own weights draws, with a position's noise, the
    target's own draw there: every drafted token is kept, in the one-row loop, in batched
    rounds and in a row running alone in a batch (a draft drawing with another position's
    noise would be kept about as often as an independent draw, ~0.2-0.6 here)."""
    from tests.conftest import build_bundle

    root = tmp_path_factory.mktemp("twin")
    bundle = build_bundle(
        root, "twin", {"draft_precision": "float32"}, arch="llama", seed=3, draft_noise=0.0
    )
    config = GenerationConfig(
        max_new_tokens=24, temperature=1.0, num_draft_tokens=3, seed=4, ignore_eos=True,
        proposer="model", draft_schedule="fixed",
    )  # fmt: skip
    cases = [
        (1, config, 6),  # a lone row
        (4, config, 6),  # batched rounds
        (4, replace(config, draft_schedule="adaptive"), 1),  # a row alone in the batch
    ]
    for batch, row_config, rows in cases:
        generator = SpeculativeGenerator.from_bundle(bundle, threads=1, max_batch=batch)
        results = generator.generate(PROMPTS[:rows], row_config)
        drafted = sum(r.stats.drafted_tokens for r in results)
        accepted = sum(r.stats.accepted_tokens for r in results)
        assert drafted > 0 and accepted == drafted, (batch, row_config.draft_schedule)


def test_seeded_rows_share_the_load_schedules_draft_length(llama_bundle):
    """Seeded sampled rows share every call with the others and draft what the load schedule
    chooses (here nothing, then always K = 2): their tokens stay the target alone's."""
    from specrt.runtime.schedules import LoadSchedule

    class Fixed(LoadSchedule):
        def __init__(self, k: int) -> None:
            super().__init__()
            self.k = k

        def _choose(self, rows: int, k_max: int) -> int:
            return min(self.k, k_max)

    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    ids = generator.encode_prompts(PROMPTS[:6])
    plain = GenerationConfig(
        max_new_tokens=16, temperature=1.0, proposer="model", draft_schedule="adaptive"
    )
    seeded = replace(plain, seed=3, max_new_tokens=24)

    def run(kinds: str, k: int, config_k: int = 3) -> dict:
        runner = BatchRunner(generator.target, generator.draft, generator.tokenizer, frozenset())
        runner.schedules["load"] = Fixed(k)
        requests = [
            Request(
                i,
                ids[i],
                replace(seeded if kind == "s" else plain, num_draft_tokens=config_k),
                np.random.default_rng([5, i]),
            )
            for i, kind in enumerate(kinds)
        ]
        return dict(runner.run(requests))

    expected = run("ssssss", 0, config_k=0)  # the target alone
    for k in (0, 2):
        mixed = run("pspssp", k)  # refills and moves, seeded rows beside others
        for i in (1, 3, 4):
            assert mixed[i].token_ids == expected[i].token_ids, (k, i)
            assert (mixed[i].stats.drafted_tokens > 0) == (k > 0)  # the schedule's K


def test_a_batched_match_may_run_past_k_where_its_width_is_priced(llama_bundle):
    """Under the load schedule, a row's match is not cut at K (the model's draft length): the
    schedule prices each width of the rows' matches and may verify more of them, as the
    one-row hybrid does (here it always takes the widest); under the fixed schedule a match
    stays within K. Every row's output is the target's alone either way."""
    from specrt.runtime.schedules import LoadSchedule

    class Widest(LoadSchedule):
        def match_option(self, rows, curves, probe=False):
            return max(map(len, curves), default=0), 1e9  # beats any model draft

    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    ids = generator.encode_prompts(PROMPTS)
    base = GenerationConfig(max_new_tokens=40, ignore_eos=True, num_draft_tokens=0)
    expected = [r.token_ids for r in generator.generate(PROMPTS, base)]
    for schedule in ("adaptive", "fixed"):
        runner = BatchRunner(generator.target, generator.draft, generator.tokenizer, frozenset())
        runner.schedules["load"] = Widest()
        config = replace(base, num_draft_tokens=2, proposer="hybrid", draft_schedule=schedule)
        reqs = [Request(i, p, config, np.random.default_rng(i)) for i, p in enumerate(ids)]
        results = dict(runner.run(reqs))
        assert [results[i].token_ids for i in range(len(ids))] == expected
        # how far into a match (or draft) any row's kept tokens reached
        reached = max(len(r.stats.accepted_per_position) for r in results.values())
        assert reached > 2 if schedule == "adaptive" else reached <= 2, schedule


def test_matches_are_measured_before_a_model_draft_can_shut_them_out(llama_bundle):
    """A match's acceptance is learnt only from verified matches: where the model's measured
    draft beats what the prior says of them, the load schedule would never verify one (an
    8-row job drafted with the model throughout, 1.3x slower than with matches). So rounds
    without a model draft verify the rows' matches until a width is measured."""
    from specrt.runtime.schedules import LoadSchedule

    class ModelFirst(LoadSchedule):  # the model's draft always looks best
        def _choose(self, rows, k_max):
            return k_max if self.measured_alone(rows) or not k_max else 0

        def expected_tokens(self, k):
            return k + 1.0

    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    ids = generator.encode_prompts(PROMPTS)
    config = GenerationConfig(
        max_new_tokens=40, ignore_eos=True, proposer="hybrid", draft_schedule="adaptive"
    )
    expected = [
        r.token_ids for r in generator.generate(PROMPTS, replace(config, num_draft_tokens=0))
    ]
    runner = BatchRunner(generator.target, generator.draft, generator.tokenizer, frozenset())
    schedule = runner.schedules["load"] = ModelFirst()
    reqs = [Request(i, p, config, np.random.default_rng(i)) for i, p in enumerate(ids)]
    results = dict(runner.run(reqs))
    assert [results[i].token_ids for i in range(len(ids))] == expected
    assert schedule.matches_measured() and runner.matches[True].counts


def test_a_round_that_grew_a_cache_is_not_what_its_width_costs(llama_bundle, monkeypatch):
    """A round whose call grew a cache paid for copying it (a wide round most often: its
    positions pass the capacity first); the load schedule learns acceptance from it but not
    its time, which would price that K or width far too high."""
    import specrt.runtime.batching as batching
    from specrt.runtime.schedules import LoadSchedule

    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    runner = BatchRunner(generator.target, generator.draft, generator.tokenizer, frozenset())
    grew: list[bool] = []  # per round, in order
    timed: list[bool] = []  # per round: whether the schedule was given its time

    def watched(target, draft, *args, **kwargs):
        before = target.resizes + draft.resizes
        steps = run_round(target, draft, *args, **kwargs)
        grew.append(target.resizes + draft.resizes != before)
        return steps

    class Recording(LoadSchedule):
        def update(self, rows, k, seconds, parts, steps):
            timed.append(seconds is not None)
            super().update(rows, k, seconds, parts, steps)

    run_round = batching.run_round
    monkeypatch.setattr(batching, "run_round", watched)
    runner.schedules["load"] = Recording()
    config = GenerationConfig(max_new_tokens=60, ignore_eos=True, draft_schedule="adaptive")
    ids = generator.encode_prompts(PROMPTS[:8])
    dict(runner.run([Request(i, p, config, np.random.default_rng(i)) for i, p in enumerate(ids)]))
    assert len(grew) == len(timed) and any(grew) and any(timed)
    assert not any(g and t for g, t in zip(grew, timed))


def test_the_load_schedule_measures_then_takes_the_best(llama_bundle):
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, draft_schedule="adaptive")
    generator.generate(PROMPTS * 3, config)
    schedule = generator._load_schedules["load"]
    measured = sorted(schedule.times)
    assert measured == list(range(len(measured))) and len(measured) >= 2  # 0, 1, ... climbed
    best = max(measured, key=lambda k: schedule.rate(4, k))
    assert schedule.choose(4, 4) in (best - 1, best, best + 1)  # or a neighbour, re-measured


class _Part:
    def __init__(self, k: int) -> None:
        self.k = k


class _Step:
    def __init__(self, accepted: int) -> None:
        self.accepted = accepted


@pytest.mark.parametrize(
    ("draft_step", "verify_slope", "acceptance", "expected"),
    [
        (0.05, 0.02, 0.9, 4),  # cheap draft, free verification, good draft: draft the most
        (0.4, 0.5, 0.5, 0),  # a full batch: every draft position costs nearly a target step
        (0.1, 0.15, 0.6, 2),  # in between: stop where one more token no longer pays
    ],
)
def test_the_load_schedule_picks_the_k_with_most_tokens_per_second(
    draft_step, verify_slope, acceptance, expected
):
    """The choice itself, on modelled rounds: T(K) = K draft steps + a verification growing
    with K (in target steps), rows accepting each position with a fixed probability."""
    from specrt.runtime.schedules import LoadSchedule

    schedule = LoadSchedule()
    rng = np.random.default_rng(0)
    for _ in range(400):
        k = schedule.choose(8, 4)
        seconds = k * draft_step + 1.0 + verify_slope * k
        accepted = [int(np.argmin(np.append(rng.random(k) < acceptance, False))) for _ in range(8)]
        schedule.update(8, k, seconds, [_Part(k)] * 8, [_Step(a) for a in accepted])
    rates = {
        k: 8 * schedule.expected_tokens(k) / (k * draft_step + 1 + verify_slope * k)
        for k in range(5)
    }
    assert max(rates, key=rates.get) == expected  # the scenario is what it says
    choices = [schedule.choose(8, 4) for _ in range(64)]
    # Near-flat optima: the acceptance is estimated, so a K within 3% of the best rate will do;
    # a few rounds re-measure a neighbour.
    good = [k for k in rates if rates[k] >= 0.97 * rates[expected]]
    assert sum(k in good for k in choices) >= 60, (choices, rates)


@pytest.mark.parametrize(
    ("cost_per_token", "curve", "expected"),
    [
        (0.4, [1.07, 1.075, 1.075, 1.075], 0),  # sampling: matches rarely kept, rows would pay
        (0.3, [1.9, 2.8, 2.9, 3.0], 2),  # the first two tokens are kept, the rest seldom
        (0.02, [1.9, 2.71, 3.44, 4.1], 4),  # a copying target, nearly free positions (a GPU)
    ],
)
def test_matches_widen_a_round_only_where_it_pays(cost_per_token, curve, expected):
    """In a round without a model draft, the load schedule chooses how many tokens of the
    rows' matches to verify, by the measured time of rounds of each width against the tokens
    the matches are expected to add. Modelled rounds of 8 rows, 6 of them with a 4-token match
    (``curve``: the tokens such a row emits when 1..4 of it are verified); a round of width w
    costs 1 + c w target steps."""
    from specrt.runtime.schedules import LoadSchedule

    schedule = LoadSchedule()
    curves = [curve] * 6
    assert schedule.match_option(8, curves)[0] == 0  # rounds without matches are measured first
    for _ in range(300):
        width = schedule.match_option(8, curves)[0]
        seconds = 1.0 + cost_per_token * width
        schedule.update(8, 0, None if width else seconds, [], [])
        if width:
            schedule.update_match_width(8, width, seconds)
    rates = [(2 + 6 * (curve[w - 1] if w else 1)) / (1 + cost_per_token * w) for w in range(5)]
    assert max(range(5), key=rates.__getitem__) == expected  # the scenario is what it says
    assert schedule.match_option(8, curves)[0] == expected
    assert LoadSchedule(adapt=False).match_option(8, curves)[0] == 4  # "fixed": every token


def test_widths_past_the_measured_ones_are_priced_by_the_cost_of_one_more_token():
    """The first token of the rows' matches costs more than each one after it (a round of
    width w: 1.5 + 0.1 w target steps, w > 0): priced by the average cost of a measured
    width's tokens, the next width would look dear and the round would stay at one token;
    priced by the fitted cost of one more, it climbs to the widths that pay (6-8 here)."""
    from specrt.runtime.schedules import LoadSchedule

    curve = list(np.cumsum([0.85**i for i in range(9)])[1:])  # each token kept with 0.85
    schedule, curves = LoadSchedule(), [curve] * 6

    def seconds(width: int) -> float:
        return 1.0 + (0.5 + 0.1 * width if width else 0.0)

    for _ in range(150):
        width = schedule.match_option(8, curves)[0]
        schedule.update(8, 0, None if width else seconds(width), [], [])
        if width:
            schedule.update_match_width(8, width, seconds(width))
    rates = [(2 + 6 * curve[w - 1] if w else 8) / seconds(w) for w in range(9)]
    good = [w for w in range(9) if rates[w] >= 0.97 * max(rates)]
    assert good == [6, 7, 8]  # the scenario is what it says
    assert sum(schedule.match_option(8, curves)[0] in good for _ in range(10)) >= 9


def test_widths_on_a_target_computing_positions_in_pairs_are_priced_by_the_pairs():
    """A target whose calls compute an even number of positions per row (``even_rows``: a
    quantised one on AVX2) verifies 1 token of matches for free (with the newest token, the 2
    positions a round without matches computes), then each pair of tokens at one price (0.9 of
    a round here: 8 rows x 4 positions cost twice 8 x 2 on AVX2's int4 kernel). Priced per
    token from width 1's free rounds, every wider width would look free and be tried, wide
    ones first: a round's time spent on each (the rates of a batch's first calls fell to
    0.46x the target alone). Priced per position, the round stays at width 1, the best."""
    from specrt.runtime.schedules import LoadSchedule

    curve = list(np.cumsum([0.6**i for i in range(13)])[1:])  # each token kept with 0.6
    curves = [curve] * 6

    def seconds(width: int) -> float:
        positions = width + 1 + (width + 1) % 2
        return 1.0 + 0.9 * (positions - 2) / 2

    def tokens(width: int) -> float:
        return 2 + 6 * curve[width - 1] if width else 8

    rates = [tokens(w) / seconds(w) for w in range(13)]
    assert max(range(13), key=rates.__getitem__) == 1  # the scenario is what it says

    def share_of_best(schedule) -> float:
        spent = emitted = 0.0
        for _ in range(100):
            width = schedule.match_option(8, curves)[0]
            spent, emitted = spent + seconds(width), emitted + tokens(width)
            schedule.update(8, 0, None if width else seconds(width), [], [])
            if width:
                schedule.update_match_width(8, width, seconds(width))
        return emitted / spent / max(rates)

    assert share_of_best(LoadSchedule()) < 0.9  # not told: widths tried on a free one's price
    assert share_of_best(LoadSchedule(even_rows=True)) > 0.95


def test_a_width_measured_on_slow_rounds_is_measured_again():
    """A width of matches whose first rounds ran slow (a cache resize, a busy machine) looks
    dear; it is measured again now and then, as a K is, so the round settles on the width that
    pays (2 of the rows' matches here: 1 + 0.3 a token, the first two rounds of width 2 slowed
    by 2 s)."""
    from specrt.runtime.schedules import LoadSchedule

    schedule, curves = LoadSchedule(), [[1.9, 2.8, 2.9, 3.0]] * 6
    twos = 0
    for _ in range(600):
        width = schedule.match_option(8, curves)[0]
        seconds = 1.0 + 0.3 * width
        if width == 2:
            twos += 1
            seconds += 2.0 if twos in (2, 3) else 0.0  # its first measured rounds (1: warm-up)
        schedule.update(8, 0, None if width else seconds, [], [])
        if width:
            schedule.update_match_width(8, width, seconds)
    assert twos > 3
    assert sum(schedule.match_option(8, curves)[0] == 2 for _ in range(10)) >= 9


def _modelled_rounds(schedule, rows: int, count: int, seconds, acceptance: float, rng) -> None:
    """``count`` rounds of ``rows`` rows as ``schedule`` chooses them, each taking
    ``seconds(rows, k)``, each draft position accepted with probability ``acceptance``."""
    for _ in range(count):
        k = schedule.choose(rows, 4)
        accepted = [
            int(np.argmin(np.append(rng.random(k) < acceptance, False))) for _ in range(rows)
        ]
        schedule.update(rows, k, seconds(rows, k), [_Part(k)] * rows, [_Step(a) for a in accepted])


def test_a_batch_size_is_priced_by_its_own_rounds():
    """A job's tail (8 rows left of 16) is priced from its own rounds, which the full batch's
    many rounds must not evict: priced from those, the target alone's round at 8 rows would
    look as dear as at 16, and drafting one token would look worth it there."""
    from specrt.runtime.schedules import LoadSchedule

    def seconds(rows: int, k: int) -> float:  # 0.3 of fixed cost, a verified position 0.1 / row
        return 0.3 + 0.05 * k + 0.1 * rows * (k + 1)

    schedule, rng = LoadSchedule(), np.random.default_rng(0)
    _modelled_rounds(schedule, 8, 100, seconds, 0.6, rng)
    _modelled_rounds(schedule, 16, 400, seconds, 0.6, rng)
    assert 8 * 1.6 / seconds(8, 1) < 8 / seconds(8, 0)  # the scenario: drafting does not pay
    assert 8 * 1.6 / seconds(8, 1) > 8 / seconds(16, 0)  # unless priced at 16 rows' cost
    assert sum(schedule.choose(8, 4) == 0 for _ in range(10)) >= 9  # (a check may come)


def test_the_target_alone_is_measured_at_each_batch_size_before_drafting_is_weighed():
    """A job's tail comes after its full batch: at 8 rows the target alone's round is measured
    before any K is weighed against it there (priced from 16 rows, it would look dear and
    drafting a bargain), and matches wait for it too."""
    from specrt.runtime.schedules import LoadSchedule

    def seconds(rows: int, k: int) -> float:  # 0.3 of fixed cost, a verified position 0.1 / row
        return 0.3 + 0.05 * k + 0.1 * rows * (k + 1)

    schedule, rng = LoadSchedule(), np.random.default_rng(5)
    _modelled_rounds(schedule, 16, 400, seconds, 0.6, rng)
    assert 8 * 1.6 / seconds(8, 1) < 8 / seconds(8, 0)  # the scenario: drafting does not pay
    assert schedule.match_option(8, [[1.9, 2.8]] * 8) == (0, None)
    assert schedule.choose(8, 4) == 0
    _modelled_rounds(schedule, 8, 100, seconds, 0.6, rng)
    assert sum(schedule.choose(8, 4) == 0 for _ in range(10)) >= 9


def test_a_model_draft_must_beat_the_round_of_matches_it_would_replace():
    """Where the rows' matches would be verified without the model (a round of K = 0 with
    matches), drafting is weighed against that round, not against the target alone: a K that
    beats the target alone but not the matches is not chosen."""
    from specrt.runtime.schedules import LoadSchedule

    def seconds(rows: int, k: int) -> float:  # a verified position 0.1 / row
        return 0.3 + 0.05 * k + 0.1 * rows * (k + 1)

    schedule, rng = LoadSchedule(), np.random.default_rng(2)
    _modelled_rounds(schedule, 4, 200, seconds, 0.9, rng)
    drafting = max(schedule.rate(4, k) for k in schedule.times if k)
    assert drafting > 1.1 * schedule.rate(4, 0)  # drafting beats the target alone
    assert sum(schedule.choose(4, 4) > 0 for _ in range(10)) >= 9
    assert sum(schedule.choose(4, 4, without_draft=1.1 * drafting) == 0 for _ in range(10)) >= 9


def test_a_k_measured_at_small_batches_is_not_trusted_at_a_full_one():
    """K = 1 measured at 2 rows only: at 16 rows it is priced as growing by its two positions
    per row times the target alone's growth, not in proportion (which would take it for cheap
    here), and so is not chosen until measured at 16 rows."""
    from specrt.runtime.schedules import LoadSchedule

    def seconds(rows: int, k: int) -> float:  # 0.3 of fixed cost, a verified position 0.1 / row
        return 0.3 + 0.05 * k + 0.1 * rows * (k + 1)

    schedule, rng = LoadSchedule(), np.random.default_rng(1)
    _modelled_rounds(schedule, 2, 100, seconds, 0.6, rng)
    assert schedule.rate(2, 1) > schedule.rate(2, 0)  # at 2 rows drafting pays
    for _ in range(3):  # the target alone at 16 rows
        schedule.update(16, 0, seconds(16, 0), [], [])
    assert 1 not in {16} & set(schedule.times[1].by_size)
    assert schedule.choose(16, 4) == 0
    assert schedule.predicted_seconds(16, 1) >= 0.9 * seconds(16, 1)


def test_a_k_measured_while_rows_were_short_is_priced_against_rounds_now():
    """Every round grows dearer as the rows grow (attention reads the whole cache), and a K not
    chosen is measured seldom: K = 1, measured when a round of the target alone took 2 s, is
    priced in proportion once those rounds take 4 s, not at the 3.5 s it took then (which
    would make it look worth drafting)."""
    from specrt.runtime.schedules import LoadSchedule

    schedule = LoadSchedule()
    for k, seconds, count in ((0, 2.0, 3), (1, 3.5, 3), (0, 4.0, 30)):
        for _ in range(count):
            accepted = [k] * 6 + [0] * 4  # 0.6 of the draft tokens kept
            schedule.update(10, k, seconds, [_Part(k)] * 10, [_Step(a) for a in accepted])
    assert schedule.predicted_seconds(10, 1) == pytest.approx(7.0)
    assert schedule.expected_tokens(1) / 3.5 > 1 / 4.0  # priced as measured, K = 1 would win
    assert schedule.choose(10, 1) == 0


def test_the_target_alone_is_measured_again_while_a_longer_draft_is_best():
    """Every K is priced against the target alone's rounds, which are not chosen while the
    best K is 2 or more (its neighbours are 1 and 3); measured slow at first (cold caches, a
    busy machine), they would keep a K that does not pay chosen for good. Every third check
    measures them again: here they take 3 s at first and 1 s after, drafting costs 0.5 s and
    0.3 s a token, and the schedule comes back to K = 0."""
    from specrt.runtime.schedules import LoadSchedule

    schedule, rng = LoadSchedule(), np.random.default_rng(6)
    rounds = [0]

    def seconds(rows: int, k: int) -> float:
        rounds[0] += 1
        plain = 3.0 if k == 0 and rounds[0] <= 3 else 1.0
        return plain + (0.5 + 0.3 * k if k else 0.0)

    _modelled_rounds(schedule, 4, 3000, seconds, 0.6, rng)
    rates = [schedule.expected_tokens(k) / seconds(4, k) for k in range(5)]
    assert max(range(5), key=rates.__getitem__) == 0 and rates[2] > rates[1]  # the scenario
    assert sum(schedule.choose(4, 4) == 0 for _ in range(10)) >= 9


def test_checks_of_the_k_not_taken_cost_a_bounded_share_of_the_time():
    """Re-measuring a K other than the best costs its round and, after rounds without
    drafting, the draft's catch-up (`charge`): checks are spaced so that they take at most
    `LOAD_EXPLORE_SHARE` of the time, however dear a catch-up is."""
    from specrt.runtime.schedules import LOAD_EXPLORE_SHARE, LoadSchedule

    def seconds(rows: int, k: int) -> float:  # drafting never pays
        return 1.0 + 1.0 * k

    checks = {}
    for catch_up in (0.0, 40.0):
        schedule, rng = LoadSchedule(), np.random.default_rng(2)
        spent = 0.0
        checks[catch_up] = 0
        for _ in range(3000):
            k = schedule.choose(8, 4)
            if k:
                checks[catch_up] += 1
                schedule.charge(catch_up)
                spent += catch_up
            spent += seconds(8, k)
            accepted = [int(np.argmin(np.append(rng.random(k) < 0.3, False))) for _ in range(8)]
            schedule.update(8, k, seconds(8, k), [_Part(k)] * 8, [_Step(a) for a in accepted])
        # beyond the first three rounds of K = 1 (which measure it), and the last check
        extra = (checks[catch_up] - 4) * (1.0 + catch_up)
        assert extra <= LOAD_EXPLORE_SHARE * spent, (catch_up, checks)
    assert checks[40.0] < checks[0.0]


def test_a_check_waits_until_the_drafts_backlog_is_repaid():
    """The draft's catch-up before a check grows with the tokens it skipped: once a catch-up
    has been timed per token, a check waits until the rounds since repay the one it would
    need now, not the last one's (which, early, caught up on little)."""
    from specrt.runtime.schedules import LOAD_EXPLORE_SHARE, LoadSchedule

    def checks(backlog: int) -> int:
        schedule, rng = LoadSchedule(), np.random.default_rng(4)
        schedule.charge(0.001, 10)  # 0.1 ms a token, measured
        count = 0
        for _ in range(2000):  # rounds of 1 s where drafting never pays
            k = schedule.choose(8, 4, backlog)
            count += k > 0
            accepted = [int(np.argmin(np.append(rng.random(k) < 0.3, False))) for _ in range(8)]
            schedule.update(8, k, 1.0 + k, [_Part(k)] * 8, [_Step(a) for a in accepted])
        return count

    assert checks(0) > checks(10**6) >= 3  # the first three rounds of K = 1 measure it
    # 10^6 tokens are 100 s to catch up on: at 2% that is 5000 s of rounds, more than 2000
    assert checks(10**6) == 3, LOAD_EXPLORE_SHARE


def test_an_admitted_prompt_is_read_by_the_target_alone_where_k_adapts(llama_bundle):
    """Where K adapts to the load the model may never draft for a row, so admitting it
    prefills the target alone (its first token waits for nothing else); the first round that
    drafts catches the draft up, and the rows are the target alone's (a seeded row's too). A
    fixed K drafts at once: the draft reads the prompt with the target."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    target, draft = generator.target, generator.draft
    ids = generator.encode_prompts(PROMPTS[:3])
    alone = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    for schedule, seed, read in (
        ("adaptive", None, False),
        ("fixed", None, True),
        ("adaptive", 5, False),
    ):
        config = GenerationConfig(
            max_new_tokens=12, num_draft_tokens=3, draft_schedule=schedule, seed=seed,
            temperature=0.0 if seed is None else 1.0, ignore_eos=True,
        )  # fmt: skip
        runner = BatchRunner(target, draft, generator.tokenizer, frozenset())
        requests = [Request(i, p, config, np.random.default_rng([7, i])) for i, p in enumerate(ids)]
        runner.add(requests)
        expected = sorted(len(p) - 1 if read else 0 for p in ids)
        assert sorted(draft.lengths[: len(ids)].tolist()) == expected, (schedule, seed)
        while runner.rows:
            runner.step()
    results = generator.generate(PROMPTS[:3], replace(config, seed=None, temperature=0.0))
    expected = alone.generate(
        PROMPTS[:3], replace(config, seed=None, temperature=0.0, num_draft_tokens=0)
    )
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]


def test_matches_not_worth_verifying_are_looked_for_less_and_less(llama_bundle, monkeypatch):
    """Where the load schedule keeps finding the rows' matches not worth verifying, rounds
    without a model draft stop looking for them for 8, 16, ... 64 rounds; the rows' output is
    the target alone's either way."""
    from specrt.runtime.schedules import LoadSchedule

    class NoMatches(LoadSchedule):  # the model never drafts, no width of matches pays
        def _choose(self, rows: int, k_max: int) -> int:
            return 0

        def match_option(self, rows: int, curves: list, probe: bool = False) -> tuple[int, float]:
            return 0, 1.0  # priced: no width pays

    calls = []
    real = planning.find_match
    monkeypatch.setattr(planning, "find_match", lambda *a: calls.append(1) or real(*a))
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    ids = generator.encode_prompts(["Simple is better " * 2, "def f(x): return x; def f"] * 2)

    def run(config: GenerationConfig) -> list[list[int]]:
        runner = BatchRunner(generator.target, generator.draft, generator.tokenizer, frozenset())
        runner.schedules["load"] = NoMatches()
        requests = [Request(i, p, config, np.random.default_rng([3, i])) for i, p in enumerate(ids)]
        results = dict(runner.run(requests))
        return [results[i].token_ids for i in range(len(ids))]

    options = dict(max_new_tokens=100, temperature=1.0, ignore_eos=True)
    alone = run(GenerationConfig(num_draft_tokens=0, **options))
    assert not calls
    hybrid = GenerationConfig(
        num_draft_tokens=4, draft_schedule="adaptive", proposer="hybrid", **options
    )
    assert run(hybrid) == alone
    rounds = 99  # after each row's first token
    assert 0 < len(calls) <= 4 * 6, len(calls)  # rounds 1, 10, 27, 60 (skips of 8, 16, 32)
    assert len(calls) < 4 * rounds / 8


def test_the_round_after_a_pause_in_matching_verifies_a_width(llama_bundle):
    """Matches found not to pay are paused, and nothing is learnt of them while they are: the
    round that ends a pause verifies a width of them anyway (a probe), without shortening the
    pauses, and the rows are the target alone's."""
    from specrt.runtime.schedules import LoadSchedule

    class Probed(LoadSchedule):  # the model never drafts; matches pay only when probed
        probes: list[bool] = []

        def _choose(self, rows: int, k_max: int) -> int:
            return 0

        def match_option(self, rows: int, curves: list, probe: bool = False) -> tuple[int, float]:
            self.probes.append(probe)
            return (1, 1.0) if probe else (0, 1.0)

        def matches_measured(self) -> bool:  # as if measured: no probes until a width is
            return True

    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    prompts = ["Simple is better " * 2, "def f(x): return x; def f"] * 2
    ids = generator.encode_prompts(prompts)
    runner = BatchRunner(generator.target, generator.draft, generator.tokenizer, frozenset())
    schedule = runner.schedules["load"] = Probed()
    options = dict(max_new_tokens=100, ignore_eos=True)
    config = GenerationConfig(
        num_draft_tokens=4, draft_schedule="adaptive", proposer="hybrid", **options
    )
    requests = [Request(i, p, config, np.random.default_rng([3, i])) for i, p in enumerate(ids)]
    results = dict(runner.run(requests))
    # looks at rounds 1, 10 (a probe), 11, 28 (a probe), 29, 62, 63: pauses of 8, 16, 32 still
    assert schedule.probes == [False, True, False, True, False, True, False], schedule.probes
    alone = generator.generate(prompts, replace(config, num_draft_tokens=0))
    assert [results[i].token_ids for i in range(4)] == [r.token_ids for r in alone]


def test_greedy_and_sampled_rows_learn_how_matches_fare_apart(llama_bundle):
    """A sampled row keeps a matched token only with probability p(x), a greedy one whenever it
    is the argmax: mixed in one estimate, each kind would be judged by the other's."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    runner = BatchRunner(generator.target, generator.draft, generator.tokenizer, frozenset())
    ids = generator.encode_prompts(PROMPTS[:4])
    for greedy in (True, False):
        config = GenerationConfig(
            max_new_tokens=24, proposer="lookup", temperature=0 if greedy else 1, ignore_eos=True
        )
        list(
            runner.run([Request(i, p, config, np.random.default_rng(i)) for i, p in enumerate(ids)])
        )
        assert runner.matches[greedy].counts  # matches were verified and counted here
        if greedy:
            assert not runner.matches[False].counts


def test_rows_admitted_while_the_model_does_not_draft_are_caught_up_later(
    llama_bundle, monkeypatch
):
    """While the load schedule has the model draft nothing, admitted prompts are not fed to
    the draft; when drafting resumes, the draft reads them (a chunk at a time) and every row
    still equals the target alone's output."""
    import specrt.backends.rows as rows_module
    from specrt.runtime.schedules import LoadSchedule

    monkeypatch.setattr(rows_module, "PREFILL_CHUNK", 4)  # whole prompts in several chunks
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    alone = GenerationConfig(max_new_tokens=24, num_draft_tokens=0, ignore_eos=True)
    expected = [r.token_ids for r in generator.generate(PROMPTS[:4], alone)]
    runner = BatchRunner(generator.target, generator.draft, generator.tokenizer, frozenset())

    class Resumes(LoadSchedule):  # nothing at first, then drafting
        def _choose(self, rows: int, k_max: int) -> int:
            return 0 if self.rounds < 3 else 3

    schedule = runner.schedules["load"] = Resumes()
    schedule.rounds, schedule.last_k = 0, 0
    choose = schedule.choose

    def counted(rows: int, k_max: int, backlog: int = 0, without_draft=None) -> int:
        schedule.rounds += 1
        return choose(rows, k_max, backlog, without_draft)

    schedule.choose = counted
    config = GenerationConfig(
        max_new_tokens=24, num_draft_tokens=3, draft_schedule="adaptive", ignore_eos=True
    )
    ids = generator.encode_prompts(PROMPTS[:4])
    requests = [Request(i, p, config, np.random.default_rng(i)) for i, p in enumerate(ids)]
    runner.add(requests)
    assert generator.draft.lengths[:4].tolist() == [0, 0, 0, 0]  # not read yet
    results = dict(runner.run([]))
    assert [results[i].token_ids for i in range(4)] == expected
    assert sum(results[i].stats.drafted_tokens for i in range(4)) > 0  # the model drafted


def test_batch_size_is_checked(llama_bundle):
    from specrt.errors import InvalidInputError

    for bad in (0, -1, 2.5, "4", True):
        with pytest.raises(InvalidInputError, match="max_batch"):
            SpeculativeGenerator.from_bundle(llama_bundle, max_batch=bad)


def poisoned_copy(bundle, tmp_path, position: int, engine: str = "onnxruntime"):
    """A copy of ``bundle`` whose target ``engine`` rotates positions from ``position`` on by
    NaN: a row that reaches them gets NaN logits (rows attend only to themselves), as an fp16
    overflow would."""
    import shutil

    import onnx
    from onnx import numpy_helper

    copy = tmp_path / "poisoned"
    shutil.copytree(bundle, copy)
    graph = copy / "target" / engine / "model.onnx"
    model = onnx.load(str(graph))
    for index, tensor in enumerate(model.graph.initializer):
        if tensor.name == "cos_cache":
            table = numpy_helper.to_array(tensor).copy()
            table[position:] = np.nan
            model.graph.initializer[index].CopyFrom(numpy_helper.from_array(table, tensor.name))
    (copy / "target" / engine / "model.onnx.data").unlink()
    onnx.save_model(model, str(graph), save_as_external_data=True, location="model.onnx.data")
    return copy


POISONED_FROM = 56


def run_with_a_long_row(bundle, max_batch: int, temperature: float, **load) -> dict:
    """Six rows, row 0 alone running past `POISONED_FROM` positions (nor its drafts reach it
    for the others), 3 draft tokens, seeded."""
    options = dict(num_draft_tokens=3, ignore_eos=True, temperature=temperature, seed=5)
    # The draft model's 3 tokens every round: a hybrid's match could widen a call past them
    options.update(proposer="model", draft_schedule="fixed")
    generator = SpeculativeGenerator.from_bundle(
        bundle, threads=1, max_batch=max_batch, check_files=False, **load
    )
    prompts = generator.encode_prompts(PROMPTS[:6])
    requests = []
    for i, ids in enumerate(prompts):
        new = 64 if i == 0 else 16
        assert (len(ids) + new > POISONED_FROM) == (i == 0)
        assert len(ids) + new + 3 < POISONED_FROM or i == 0  # nor its drafts
        config = GenerationConfig(max_new_tokens=new, **options)
        requests.append(Request(i, ids, config, np.random.default_rng([5, i])))
    return dict(generator.run(requests))


def assert_row_0_failed_alone(results: dict, expected: dict) -> None:
    assert results[0].finish_reason == "error" and "NaN/inf" in results[0].error
    assert results[0].to_dict() == {"error": {"message": results[0].error}}
    for i in range(1, 6):
        assert results[i].error is None
        assert results[i].token_ids == expected[i].token_ids, i


@pytest.mark.parametrize(("max_batch", "temperature"), [(4, 0.0), (4, 1.0), (1, 0.0)])
def test_a_row_with_nan_logits_fails_alone(llama_bundle, tmp_path, max_batch, temperature):
    """One row's NaN logits end that row with an error result; the rows sharing its calls,
    and those given its slot after it, give the tokens they give without it (greedy: the
    target alone's; seeded: the same draws). Only row 0 runs long enough to reach the
    poisoned positions."""
    options = dict(num_draft_tokens=3, ignore_eos=True, temperature=temperature, seed=5)
    expected = run_with_a_long_row(llama_bundle, max_batch, temperature)
    poisoned = poisoned_copy(llama_bundle, tmp_path, POISONED_FROM)
    assert_row_0_failed_alone(run_with_a_long_row(poisoned, max_batch, temperature), expected)
    generator = SpeculativeGenerator.from_bundle(
        tmp_path / "poisoned", threads=1, max_batch=max_batch, check_files=False
    )
    with pytest.raises(NumericalError):  # generate() raises, as the one-row loop always did
        generator.generate(PROMPTS[:2], GenerationConfig(max_new_tokens=64, **options))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_prompt_that_reaches_nan_logits_fails_alone_at_admission(
    llama_bundle, tmp_path, temperature
):
    """A prompt long enough to reach the poisoned positions fails at its admission (its first
    token's logits are NaN); the prompts admitted with it run as they do without it."""
    options = dict(num_draft_tokens=3, ignore_eos=True, temperature=temperature, seed=5)
    poisoned = poisoned_copy(llama_bundle, tmp_path, 30)
    results = {}
    for bundle in (llama_bundle, poisoned):
        generator = SpeculativeGenerator.from_bundle(
            bundle, threads=1, max_batch=4, check_files=False
        )
        short = generator.encode_prompts(PROMPTS[:3])
        prompts = [generator.encode_prompts([" ".join(PROMPTS[:8])])[0][:40], *short]
        assert len(prompts[0]) > 30 and all(len(p) + 8 + 3 < 30 for p in short)
        config = GenerationConfig(max_new_tokens=8, **options)
        requests = [
            Request(i, p, config, np.random.default_rng([5, i])) for i, p in enumerate(prompts)
        ]
        results[bundle] = dict(generator.run(requests))
    clean, failed = results[llama_bundle], results[poisoned]
    assert failed[0].finish_reason == "error" and "NaN/inf" in failed[0].error
    assert failed[0].token_ids == [] and clean[0].error is None
    for i in (1, 2, 3):
        assert failed[i].error is None and failed[i].token_ids == clean[i].token_ids, i


def test_a_row_that_copied_its_beginning_and_reaches_nan_fails_alone(llama_bundle, tmp_path):
    """Two prompts sharing 20 tokens: the shorter reads them, the longer copies them and its
    pass reaches NaN (positions 30 on): it fails alone, and the shorter runs as it does
    without it."""
    poisoned = poisoned_copy(llama_bundle, tmp_path, 30)
    config = GenerationConfig(max_new_tokens=4, num_draft_tokens=2, ignore_eos=True)
    results = {}
    for bundle in (llama_bundle, poisoned):
        generator = SpeculativeGenerator.from_bundle(
            bundle, threads=1, max_batch=4, check_files=False
        )
        long = generator.encode_prompts([" ".join(PROMPTS[:8])])[0][:40]
        prompts = [long, long[:20] + generator.encode_prompts(PROMPTS[:1])[0][1:3]]
        assert len(prompts[1]) + 4 + 2 < 30
        results[bundle] = dict(generator.run(Request(i, p, config) for i, p in enumerate(prompts)))
    clean, failed = results[llama_bundle], results[poisoned]
    assert failed[0].finish_reason == "error" and clean[0].error is None
    assert failed[1].error is None and failed[1].token_ids == clean[1].token_ids


def test_a_row_alone_in_the_batch_drafts_as_the_one_row_loop(llama_bundle):
    """The only row of a batch (a service with one client, a job's last row) runs the one-row
    loop's rounds: the adaptive schedule stops drafting token by token, where the load
    schedule decides per round; its tokens are the target alone's."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    alone = GenerationConfig(max_new_tokens=40, num_draft_tokens=0, ignore_eos=True)
    [expected] = generator.generate(PROMPTS[:1], alone)
    config = GenerationConfig(
        max_new_tokens=40, ignore_eos=True, draft_schedule="adaptive", proposer="model"
    )
    [(_, result)] = generator.run(
        [Request(0, generator.encode_prompts(PROMPTS[:1])[0], config, np.random.default_rng(0))]
    )
    assert result.token_ids == expected.token_ids
    schedule = generator._schedules[("adaptive", config.num_draft_tokens, True, False)]
    # Every round after the first token's step (the target alone) was the one-row one
    assert len(schedule.verify_time) == result.stats.rounds - 1
    assert "load" not in generator._load_schedules  # and the load schedule never ran


def test_admitted_rows_have_their_first_token_before_any_round(llama_bundle):
    """Admission prefills the prompts and gives each row its first token, the target alone's,
    at once (a service hands it out then), before any round of the batch."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    alone = GenerationConfig(max_new_tokens=1, num_draft_tokens=0, ignore_eos=True)
    expected = [r.token_ids for r in generator.generate(PROMPTS[:3], alone)]
    runner = BatchRunner(generator.target, generator.draft, generator.tokenizer, frozenset())
    config = GenerationConfig(max_new_tokens=20)
    ids = generator.encode_prompts(PROMPTS[:3])
    requests = [Request(i, p, config, np.random.default_rng(i)) for i, p in enumerate(ids)]
    assert runner.add(requests) == []
    assert [new for _, new, _ in runner.active()] == expected
    assert [len(row.tokens) for row in runner.rows] == [len(p) + 1 for p in ids]
    for (key, result), _ in zip(runner.run([]), range(3)):  # the rest: the target's own
        assert result.token_ids[:1] == expected[key]


def test_a_prompt_is_read_in_one_call_of_its_own_row_that_gives_its_first_token(llama_bundle):
    """Admitting a prompt costs one call of its row alone: it feeds the prompt (short of a
    prefill chunk) and its last position gives the first token, the target alone's. No pass
    of its own for the first token, and no call on several rows, which would attend over all
    the positions a long running row grew."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    target = generator.target
    runner = BatchRunner(target, generator.draft, generator.tokenizer, frozenset())
    config = GenerationConfig(max_new_tokens=50, num_draft_tokens=3, ignore_eos=True)
    ids = generator.encode_prompts(PROMPTS[:3])
    requests = [Request(i, p, config, np.random.default_rng(i)) for i, p in enumerate(ids)]
    runner.add(requests[:1])
    for _ in range(10):  # the running row grows the cache
        runner.step()
    assert target.capacity > max(map(len, ids[1:])) + 8
    calls, call = [], target._call
    target._call = lambda start, n, tokens, *a, **k: (
        calls.append((n, tokens.shape[1])) or call(start, n, tokens, *a, **k)
    )
    runner.add(requests[1:])
    assert calls == [(1, len(p)) for p in sorted(ids[1:], key=len)]
    target._call = call
    results = dict(runner.run([]))
    alone = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    expected = alone.generate(PROMPTS[:3], replace(config, num_draft_tokens=0))
    assert [results[i].token_ids for i in range(3)] == [r.token_ids for r in expected]


def test_a_prompt_longer_than_a_chunk_is_read_in_whole_chunks_then_its_end(
    llama_bundle, monkeypatch
):
    """As in the one-row loop, a prompt's whole prefill chunks go first (the rows together),
    then its end in a call of its own row that gives the first token; the rows are the target
    alone's (chunks of 8 positions here, 256 in use)."""
    from specrt.backends import base, rows

    monkeypatch.setattr(base, "PREFILL_CHUNK", 8)  # `whole_chunks`
    monkeypatch.setattr(rows, "PREFILL_CHUNK", 8)
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    target = generator.target
    runner = BatchRunner(target, generator.draft, generator.tokenizer, frozenset())
    config = GenerationConfig(max_new_tokens=12, num_draft_tokens=3, ignore_eos=True)
    ids = sorted(generator.encode_prompts(PROMPTS[:3]), key=len)
    assert max(map(len, ids)) > 9
    calls, call = [], target._call
    target._call = lambda start, n, tokens, *a, **k: (
        calls.append((start, n, tokens.shape[1])) or call(start, n, tokens, *a, **k)
    )
    runner.add([Request(i, p, config, np.random.default_rng(i)) for i, p in enumerate(ids)])
    target._call = call
    ends = [(slot, 1, len(p) - (len(p) - 1) // 8 * 8) for slot, p in enumerate(ids)]
    assert calls[-3:] == ends
    assert calls[:-3] and all(width == 8 for _, _, width in calls[:-3])  # the chunks before
    results = dict(runner.run([]))
    expected = generator.generate(ids, replace(config, num_draft_tokens=0))
    assert [results[i].token_ids for i in range(3)] == [r.token_ids for r in expected]


@pytest.mark.parametrize("chunk", [8, 256])
def test_a_prompt_several_rows_share_is_read_once(llama_bundle, monkeypatch, chunk):
    """Rows admitted with one prompt (``n`` samples, a law's rows, a shared system prompt):
    the first reads it, in whole chunks then its end, and the others copy both caches and
    draw their own first token from its logits. Each row is still the target alone's, greedy
    and seeded (chunks of 8 positions too, as a long prompt has them at 256)."""
    from specrt.backends import base, rows

    monkeypatch.setattr(base, "PREFILL_CHUNK", chunk)  # `whole_chunks`
    monkeypatch.setattr(rows, "PREFILL_CHUNK", chunk)
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=6)
    target, draft = generator.target, generator.draft
    long, short = sorted(generator.encode_prompts(PROMPTS[:2]), key=len)[::-1]
    assert len(long) > 9
    ids = [long, short, long, long, short, long]
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=3)):
        config = GenerationConfig(max_new_tokens=12, num_draft_tokens=3, ignore_eos=True,
                                  draft_schedule="fixed", proposer="model", **sampling)  # fmt: skip
        runner = BatchRunner(target, draft, generator.tokenizer, frozenset())
        fed = {"target": 0, "draft": 0}
        for name, decoder in (("target", target), ("draft", draft)):
            monkeypatch.setattr(decoder, "_call", counted(decoder._call, fed, name))
        runner.add([Request(i, p, config, row_rng(config, i)) for i, p in enumerate(ids)])
        assert fed == {"target": len(long) + len(short), "draft": len(long) + len(short) - 2}
        assert target.lengths[:6].tolist() == [len(p) for p in sorted(ids, key=len)]
        assert draft.lengths[:6].tolist() == [len(p) - 1 for p in sorted(ids, key=len)]
        monkeypatch.undo()
        results = dict(runner.run([]))
        expected = generator.generate(ids, replace(config, num_draft_tokens=0))
        assert [results[i].token_ids for i in range(6)] == [r.token_ids for r in expected]
        assert sum(results[i].stats.drafted_tokens for i in range(6))
        monkeypatch.setattr(base, "PREFILL_CHUNK", chunk)
        monkeypatch.setattr(rows, "PREFILL_CHUNK", chunk)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("arch", ENGINE_MODEL_TYPES)
def test_a_prompt_that_begins_as_a_running_row_reads_only_the_rest(
    bundles, monkeypatch, arch, temperature
):
    """A shared system prompt: a row admitted while another runs, or beside one that reads
    its prompt whole, copies the positions their tokens share from it (16 or more) and the
    target reads the rest alone; a prefix under 16 tokens is read as before. Every row is the
    target alone's, greedy or seeded, in every family (sliding windows among them)."""
    generator = SpeculativeGenerator.from_bundle(bundles[arch], threads=1, max_batch=4)
    target = generator.target
    system = generator.encode_prompts([" ".join(PROMPTS[5:9])])[0]
    assert len(system) >= 24
    ends = [generator.encode_prompts([p])[0][1:] for p in PROMPTS[2:5]]
    ids = [system + ends[0], system[:20] + ends[1], system[:10] + ends[2]]
    config = GenerationConfig(max_new_tokens=12, num_draft_tokens=3, ignore_eos=True,
                              temperature=temperature, seed=5)  # fmt: skip
    runner = BatchRunner(target, generator.draft, generator.tokenizer, frozenset())
    requests = [Request(i, p, config, row_rng(config, i)) for i, p in enumerate(ids)]
    runner.add(requests[:1])
    runner.step()
    fed = {"target": 0}
    monkeypatch.setattr(target, "_call", counted(target._call, fed, "target"))
    runner.add(requests[1:2])
    assert fed["target"] == len(ids[1]) - 20
    runner.add(requests[2:])  # 10 tokens in common: read whole
    assert fed["target"] == len(ids[1]) - 20 + len(ids[2])
    monkeypatch.undo()
    results = dict(runner.run([]))
    expected = generator.generate(ids, replace(config, num_draft_tokens=0))
    assert [results[i].token_ids for i in range(3)] == [r.token_ids for r in expected]
    # admitted together: the first reads, the others copy from it once it has
    runner = BatchRunner(target, generator.draft, generator.tokenizer, frozenset())
    together = [ids[1], ids[2], ids[0], ids[1]]
    requests = [Request(i, p, config, row_rng(config, i)) for i, p in enumerate(together)]
    fed["target"] = 0
    monkeypatch.setattr(target, "_call", counted(target._call, fed, "target"))
    runner.add(requests)
    monkeypatch.undo()
    assert fed["target"] == len(ids[0]) + len(ids[1]) - 20 + len(ids[2])
    results = dict(runner.run([]))
    expected = generator.generate(together, replace(config, num_draft_tokens=0))
    assert [results[i].token_ids for i in range(4)] == [r.token_ids for r in expected]


@pytest.mark.parametrize("arch", ENGINE_MODEL_TYPES)
def test_a_prompt_that_begins_as_a_finished_row_reads_only_the_rest(bundles, monkeypatch, arch):
    """Requests one after another with one system prompt (a service's), and a chat's next
    turn repeating the conversation so far: a finished row's target cache stays in a free
    slot, and a later prompt sharing 16 tokens or more with it copies them and reads the rest
    (`cached_tokens` counts them), in every family (sliding windows among them), greedy and
    seeded. The kept rows move with the cache's rows as it grows past them (a long row in
    between) and shrinks back, and every row is the target alone's."""
    from specrt.backends import rows

    monkeypatch.setattr(rows, "CAPACITY_STEP", 16)  # read at init: resizes every 16 positions
    generator = SpeculativeGenerator.from_bundle(bundles[arch], threads=1, max_batch=3)
    monkeypatch.undo()
    target = generator.target
    system = generator.encode_prompts([" ".join(PROMPTS[5:9])])[0]
    ends = [generator.encode_prompts([p])[0][1:] for p in PROMPTS[2:5]]
    long = generator.encode_prompts([" ".join(PROMPTS[10:16])])[0]
    assert len(system) >= 24 and len(long) > len(system) + 32
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=5)):
        config = GenerationConfig(max_new_tokens=12, num_draft_tokens=3, ignore_eos=True,
                                  proposer="model", **sampling)  # fmt: skip
        target.reset()  # nothing kept from the greedy pass
        runner = generator.runner()
        fed = {"target": 0}
        monkeypatch.setattr(target, "_call", counted(target._call, fed, "target"))

        def alone(key, prompt, runner=runner, config=config, fed=fed):
            return run_alone(runner, Request(key, prompt, config, row_rng(config, key)), fed)

        first, read = alone(0, system + ends[0])
        assert read == len(system + ends[0]) and first.stats.cached_tokens == 0
        result, read = alone(1, long)  # grows the cache past the kept row, which moves
        assert read == len(long)
        second, read = alone(2, system + ends[1])  # the cache shrank back first
        shared = common(system + ends[0], system + ends[1])
        assert read == len(system + ends[1]) - shared and second.stats.cached_tokens == shared
        turn = system + ends[0] + first.token_ids + ends[2]  # the first's conversation goes on
        third, read = alone(3, turn)
        held = len(system + ends[0]) + len(first.token_ids) - 1  # (its last token: maybe not fed)
        assert third.stats.cached_tokens >= held and read == len(turn) - third.stats.cached_tokens
        monkeypatch.undo()
        prompts = [system + ends[0], long, system + ends[1], turn]
        expected = generator.generate(prompts, replace(config, num_draft_tokens=0))
        got = [r.token_ids for r in (first, result, second, third)]
        assert got == [r.token_ids for r in expected]


@pytest.mark.parametrize("max_batch", [1, 3])
def test_new_rows_take_kept_rows_slots(llama_bundle, monkeypatch, max_batch):
    """A kept row's slot is a free one: with one slot, the next row is admitted where the
    kept row is and reads only the rest there; rows that fill the batch take the kept slots,
    which are given up (the rows read as they would without them), and every row is the
    target alone's."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=max_batch)
    target = generator.target
    system = generator.encode_prompts([" ".join(PROMPTS[5:9])])[0]
    ends = [generator.encode_prompts([p])[0][1:] for p in PROMPTS[2:6]]
    prompts = [system + end for end in ends]
    config = GenerationConfig(max_new_tokens=8, num_draft_tokens=2, ignore_eos=True,
                              draft_schedule="fixed", proposer="model")  # fmt: skip
    runner = generator.runner()
    results = dict(runner.run([Request(0, prompts[0], config)]))
    assert list(runner.kept.slots) == [max_batch - 1]
    fed = {"target": 0}
    monkeypatch.setattr(target, "_call", counted(target._call, fed, "target"))
    later = [Request(i, p, config) for i, p in enumerate(prompts[1 : max_batch + 1], 1)]
    runner.add(later)
    monkeypatch.undo()
    if max_batch == 1:  # in its own slot
        assert fed["target"] == len(prompts[1]) - common(prompts[0], prompts[1])
    else:  # the kept slot taken: the first reads, the others copy from it
        first = min(prompts[1:4], key=len)  # (admitted by length)
        rest = [p for p in prompts[1:4] if p is not first]
        assert fed["target"] == len(first) + sum(len(p) - common(first, p) for p in rest)
    assert runner.kept.slots == {}
    results.update(runner.run([]))
    expected = generator.generate(prompts[: len(results)], replace(config, num_draft_tokens=0))
    assert [results[i].token_ids for i in range(len(results))] == [r.token_ids for r in expected]


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_generators_calls_share_the_kept_rows_and_its_own_use_of_row_0(llama_bundle, max_batch):
    """`generate` after `generate` (one request after another from Python) copies a beginning
    the last call's row held. The cache gives a kept slot up where anything writes it: a
    caller using row 0 as a one-row decoder, where one slot keeps the row in place, makes the
    next call read its prompt whole, and every answer is the target alone's."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=max_batch)
    alone = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    system = generator.encode_prompts([" ".join(PROMPTS[5:9])])[0]
    ends = [generator.encode_prompts([p])[0][1:] for p in PROMPTS[2:5]]
    prompts = [system + end for end in ends]
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    expected = alone.generate(prompts, replace(config, num_draft_tokens=0))
    [first] = generator.generate(prompts[:1], config)
    [second] = generator.generate(prompts[1:2], config)
    assert first.stats.cached_tokens == 0
    assert second.stats.cached_tokens == common(prompts[0], prompts[1])
    generator.target.set_length(0, 0)
    generator.target.forward(ends[2][:3], keep_last=1)  # row 0 as a one-row decoder
    [third] = generator.generate(prompts[2:3], config)
    if max_batch == 1:  # the kept row was in slot 0
        assert third.stats.cached_tokens == 0
    else:
        assert third.stats.cached_tokens == max(common(p, prompts[2]) for p in prompts[:2])
    got = [r.token_ids for r in (first, second, third)]
    assert got == [r.token_ids for r in expected]
    generator.forget_kept_rows()  # what timing one mode against another needs
    [again] = generator.generate(prompts[2:3], config)
    assert again.stats.cached_tokens == 0 and again.token_ids == third.token_ids


def test_a_dropped_generator_frees_its_cache_whatever_it_kept(llama_bundle):
    """The keeper of a cache's finished rows holds the cache weakly: a generator dropped after
    its calls frees its models (a strong reference kept every generator a process loaded)."""
    import gc
    import weakref

    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=2)
    system = generator.encode_prompts([" ".join(PROMPTS[5:9])])[0]
    generator.generate([system, system[:20]], GenerationConfig(max_new_tokens=4))
    cache = weakref.ref(generator.rows_decoders[0])
    assert KeptRows.of(cache()).slots  # it kept a row
    del generator
    gc.collect()
    assert cache() is None


def test_rows_sharing_calls_take_back_the_capacity_kept_rows_hold(llama_bundle, monkeypatch):
    """A long finished row kept at idle holds the target's capacity for the next row alone,
    whose calls see its own positions only; rows admitted together would attend over all of
    it, so the cache gives it back as they come (the kept row cut to what it holds), and the
    rows are still the target alone's."""
    from specrt.backends import rows
    from specrt.runtime.batching import SHRINK_HEADROOM

    monkeypatch.setattr(rows, "CAPACITY_STEP", 16)
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=3)
    target, keeper = generator.rows_decoders[0], KeptRows.of(generator.rows_decoders[0])
    long = [t for p in generator.encode_prompts(PROMPTS[:12]) for t in p][:90]
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    generator.generate([long], config)
    assert keeper.longest >= len(long) and target.capacity >= len(long)
    short = [generator.encode_prompts([p])[0] for p in PROMPTS[2:4]]
    assert max(map(len, short)) + 6 + SHRINK_HEADROOM < 80
    results = generator.generate(short, config)
    assert target.capacity < 80 and keeper.longest <= target.capacity
    alone = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    expected = alone.generate(short, replace(config, num_draft_tokens=0))
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=2)])
def test_logprobs_are_the_targets_log_softmax_at_each_new_token(llama_bundle, sampling):
    """``logprobs``: each new token's log-probability under the target's raw logits at its
    position, and the most likely tokens there, in rows sharing calls with speculation on;
    checked against one plain target pass over the prompt and the tokens (an off-by-one
    position or a warped distribution fails)."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=3)
    reference = SpeculativeGenerator.from_bundle(llama_bundle, threads=1).target
    prompts = generator.encode_prompts(PROMPTS[:3])
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True, logprobs=3, **sampling)
    results = generator.generate(prompts, config)
    assert sum(r.stats.accepted_tokens for r in results) > 0  # drafts were verified
    for prompt, result in zip(prompts, results):
        new = result.token_ids
        expected = log_softmax_after(reference, prompt + new[:-1], len(new))
        got = [entry.logprob for entry in result.logprobs]
        assert [entry.token for entry in result.logprobs] == new
        np.testing.assert_allclose(got, expected[np.arange(len(new)), new], atol=1e-4)
        for entry, row in zip(result.logprobs, expected):
            assert [t for t, _ in entry.top] == np.argsort(-row, kind="stable")[:3].tolist()
    [plain] = generator.generate(prompts[:1], replace(config, logprobs=None))
    assert plain.logprobs is None and "logprobs" not in plain.to_dict()


def test_a_failed_row_gives_the_kept_rows_up(llama_bundle, tmp_path, monkeypatch):
    """After a row's logits came out NaN every slot is cleared past its rows' positions, kept
    rows' too: a prompt that begins as a kept row did reads it whole, and is the target
    alone's (copying the cleared slot would give another answer)."""
    poisoned = poisoned_copy(llama_bundle, tmp_path, 40)
    generator = SpeculativeGenerator.from_bundle(poisoned, threads=1, max_batch=3,
                                                 check_files=False)  # fmt: skip
    clean = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    system = generator.encode_prompts([" ".join(PROMPTS[5:9])])[0][:24]
    ends = [generator.encode_prompts([p])[0][1:4] for p in PROMPTS[2:4]]
    config = GenerationConfig(max_new_tokens=4, num_draft_tokens=2, ignore_eos=True)
    runner = generator.runner()
    [(_, first)] = runner.run([Request(0, system + ends[0], config)])
    assert first.error is None and runner.kept.slots
    [(_, failed)] = runner.run([Request(1, system + ends[0] + [5] * 20, config)])
    assert failed.finish_reason == "error" and runner.kept.slots == {}
    [(_, last)] = runner.run([Request(2, system + ends[1], config)])
    assert last.stats.cached_tokens == 0
    [expected] = clean.generate([system + ends[1]], replace(config, num_draft_tokens=0))
    assert last.token_ids == expected.token_ids


def run_alone(runner: BatchRunner, request: Request, fed: dict):
    """``request`` admitted alone and run to its end: its result, and what the target was fed
    to admit it."""
    fed["target"] = 0
    finished = runner.add([request])
    admitted = fed["target"]
    while runner.rows:
        finished += runner.step()
    [(_, result)] = finished
    return result, admitted


def common(held: list[int], prompt: list[int]) -> int:
    """The tokens ``prompt`` shares with the beginning of ``held``, all but its last at most."""
    most = min(len(held), len(prompt) - 1)
    return next((i for i in range(most) if held[i] != prompt[i]), most)


def counted(call, fed: dict, name: str):
    """``call`` (a decoder's ``_call``), adding the real positions each call feeds to
    ``fed[name]``."""

    def counting(start, n, tokens, keep_last, count, *args, **kwargs):
        fed[name] += int(np.broadcast_to(count, n).sum())
        return call(start, n, tokens, keep_last, count, *args, **kwargs)

    return counting


@pytest.mark.parametrize("max_batch", [1, 3])
def test_the_caches_give_back_what_they_grew_once_every_row_left(
    llama_bundle, monkeypatch, max_batch
):
    """Attention over several rows reads a cache's whole capacity, so after a long row the
    next rows would pay for its positions: once no row is left (an empty batch) both caches
    shrink back to one step, the target's to what its kept finished rows hold
    (`prefixes.KeptRows`), and the rows after are still the target alone's. With one row its
    calls see its own positions only, so the capacity stays (regrowing it would copy)."""
    from specrt.backends import rows

    monkeypatch.setattr(rows, "CAPACITY_STEP", 16)
    generator = SpeculativeGenerator.from_bundle(llama_bundle, max_batch=max_batch)
    alone = SpeculativeGenerator.from_bundle(llama_bundle)
    caches = (generator.target, generator.draft)
    options = dict(ignore_eos=True, num_draft_tokens=3, proposer="model", draft_schedule="fixed")
    for prompts, new_tokens in ((PROMPTS, 40), (PROMPTS[:1], 4), (PROMPTS[1:3], 30)):
        config = GenerationConfig(max_new_tokens=new_tokens, **options)
        results = generator.generate(prompts, config)
        expected = alone.generate(prompts, replace(config, num_draft_tokens=0))
        assert [r.token_ids for r in results] == [r.token_ids for r in expected]
        capacity = [cache.capacity for cache in caches]
        if new_tokens == 4 and max_batch == 1:  # a short row after long ones
            assert min(capacity) > 16
            assert all(cache._rows[2] < cache.capacity for cache in caches)  # its views
        elif new_tokens == 4:
            kept = KeptRows.of(generator.rows_decoders[0]).longest
            assert kept > 16 and capacity == [-(-kept // 16) * 16, 16]
        else:
            assert min(capacity) > 16


def test_rows_attend_over_little_more_than_the_longest_row(llama_bundle):
    """A call on several rows attends over the cache's whole capacity, so the capacity follows
    the longest row closely (one `CAPACITY_STEP` of 32 positions, and the headroom a shrink
    keeps): on 2 demo cores a 16-row target step costs 2.8 ms at 256 positions, 5.1 ms at 512.
    The rows are still the target alone's."""
    from specrt.backends.rows import CAPACITY_STEP
    from specrt.runtime.batching import SHRINK_HEADROOM

    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    target = generator.target
    seen, call = [], target._call

    def recorded(start, n, tokens, *args, **kwargs):
        out = call(start, n, tokens, *args, **kwargs)
        if n > 1:
            seen.append((target.capacity, int(target.lengths.max())))
        return out

    target._call = recorded
    options = dict(max_new_tokens=50, num_draft_tokens=3, proposer="model", ignore_eos=True)
    configs = [GenerationConfig(**options) for _ in PROMPTS]
    results = run_all(generator, configs)
    alone = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    for key, result in results.items():
        [expected] = alone.generate([requests(alone, configs)[key].prompt], configs[key])
        assert result.token_ids == expected.token_ids, key
    # A step, the headroom a shrink keeps, a round's 4 positions (a step of 256 fails this)
    assert CAPACITY_STEP + SHRINK_HEADROOM + 4 <= 68
    assert seen and all(c <= longest + 68 for c, longest in seen), seen
    assert max(longest for _, longest in seen) > 68  # the rows outgrew the first step


def test_a_cache_of_one_row_grows_in_large_steps(llama_bundle):
    """One row's calls see only its own positions, so its cache's capacity costs memory, not
    compute: it grows in large steps (each resize copies the row), not in the small steps a
    batch's cache takes; the row is the target alone's either way."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    target = generator.target
    resizes, grow = [], target._grow
    target._grow = lambda needed: resizes.append(needed) or grow(needed)
    config = GenerationConfig(max_new_tokens=60, num_draft_tokens=3, ignore_eos=True)
    [result] = generator.generate([PROMPTS[0]], config)
    assert len(result.token_ids) == 60 and result.stats.prompt_tokens + 60 > 64
    assert resizes == []  # a step of 32 would have grown it at 32 and 64 positions
    [alone] = generator.generate([PROMPTS[0]], replace(config, num_draft_tokens=0))
    assert result.token_ids == alone.token_ids


def test_a_one_row_call_attends_over_its_own_positions_only(llama_bundle, monkeypatch):
    """A call on one row binds the first positions of its row (`VIEW_STEP` past its length),
    not the whole capacity another row grew: the logits are those of a call on both rows,
    which attends over all of it."""
    from specrt.backends import batched

    monkeypatch.setattr(batched, "VIEW_STEP", 8)
    target = SpeculativeGenerator.from_bundle(llama_bundle, max_batch=2).target
    rng = np.random.default_rng(0)
    long, short = (rng.integers(3, target.vocab_size, size).tolist() for size in (90, 9))
    target.prefill_rows(0, [long, short])  # row 0 grows the capacity past 90 positions
    step = np.array([[5, 6, 7], [5, 6, 7]])
    both = target.forward_rows(step, keep_last=3).logits[1].copy()
    target.set_length(1, len(short))
    alone = target.forward_rows(step[1:], keep_last=3, start=1)
    assert target._bound.mask.shape[-1] == 16 < target.capacity  # 9 + 3 positions, in steps of 8
    np.testing.assert_allclose(alone.logits[0], both, rtol=0, atol=1e-5)
    assert target.lengths.tolist() == [93, 12]


def test_a_batch_gives_back_what_a_row_that_left_had_grown(llama_bundle, monkeypatch):
    """Attention over several rows reads the whole capacity: once a long row leaves, the
    capacity steps no live row needs are given back at once (not only when the batch
    empties), and the rows are still the target alone's."""
    from specrt.backends import rows
    from specrt.runtime import batching

    monkeypatch.setattr(rows, "CAPACITY_STEP", 16)
    monkeypatch.setattr(batching, "SHRINK_HEADROOM", 4)
    generator = SpeculativeGenerator.from_bundle(llama_bundle, max_batch=2)
    resizes = []  # (capacity before, after, whether a row was live)

    def spied(cache, grow):
        def resize(needed: int) -> None:
            before = cache.capacity
            grow(needed)
            resizes.append((before, cache.capacity, bool(cache.lengths.any())))

        return resize

    for cache in (generator.target, generator.draft):
        cache._grow = spied(cache, cache._grow)
    configs = [
        GenerationConfig(max_new_tokens=40 if i == 0 else 4, num_draft_tokens=3, ignore_eos=True)
        for i in range(8)
    ]
    results = run_all(generator, configs)
    alone = SpeculativeGenerator.from_bundle(llama_bundle)
    for key, result in results.items():
        [expected] = alone.generate([requests(alone, configs)[key].prompt], configs[key])
        assert result.token_ids == expected.token_ids, key
    assert any(after < before and live for before, after, live in resizes), resizes


def test_a_row_far_behind_its_neighbours_is_fed_apart(llama_bundle):
    """Prefilling (or catching the draft up on) rows of very different lengths: a call pads
    every row to its longest, so the long row goes alone (one call of 60 positions, not four),
    and every row ends where it would have, fed by itself."""
    from specrt.backends.rows import padded_runs

    assert padded_runs([3, 3, 60, 2, 0, 0, 5]) == [(0, 2), (2, 3), (3, 4), (6, 7)]
    assert padded_runs([40, 40, 40]) == [(0, 3)]  # like lengths share a call
    assert padded_runs([0, 0]) == []
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    target = generator.target
    rng = np.random.default_rng(0)
    pieces = [rng.integers(3, 40, n).tolist() for n in (3, 4, 60, 2)]
    calls, call = [], target._call

    def recorded(start, n, tokens, *args, **kwargs):
        calls.append((start, n, tokens.shape[1]))
        return call(start, n, tokens, *args, **kwargs)

    target._call = recorded
    target.prefill_rows(0, pieces)
    assert (2, 1, 60) in calls and all(n * width < 100 for _, n, width in calls), calls
    assert target.lengths.tolist() == [3, 4, 60, 2]
    together = target.forward_rows(np.array([[5]] * 4), keep_last=1).logits[:, 0]
    for row, piece in enumerate(pieces):  # each row alone, from scratch
        target.lengths[:] = 0
        target.prefill_rows(row, [piece])
        alone = target.forward_rows(np.array([[5]]), keep_last=1, start=row).logits[0, 0]
        np.testing.assert_allclose(together[row], alone, atol=1e-4)


def test_padding_past_a_long_row_does_not_grow_the_cache(llama_bundle, monkeypatch):
    """A wide call pads a row that feeds fewer tokens: its padding must not grow the cache
    every row attends over (it lands in the last slot, which no real token reads); the real
    tokens' logits are those of the row fed alone. A real token that needs the last slot
    still grows it."""
    from specrt.backends import rows

    monkeypatch.setattr(rows, "CAPACITY_STEP", 16)
    target = SpeculativeGenerator.from_bundle(llama_bundle, max_batch=2).target
    rng = np.random.default_rng(1)
    long, short = (rng.integers(3, target.vocab_size, size).tolist() for size in (13, 3))
    target.prefill_rows(0, [long, short])
    assert target.capacity == 16
    wide = np.array([[5, 0, 0, 0], [5, 6, 7, 8]])  # row 0: one real token, 3 padding
    both = target.forward_rows(wide, keep_last=4, fed=np.array([1, 4])).logits.copy()
    assert target.capacity == 16 and target.lengths.tolist() == [14, 7]
    for row, count in ((0, 1), (1, 4)):  # each row fed alone after its prefix
        target.set_length(row, target.lengths[row] - count)
        alone = target.forward_rows(wide[row : row + 1, :count], keep_last=count, start=row)
        np.testing.assert_allclose(alone.logits[0], both[row, :count], rtol=0, atol=1e-5)
    target.forward_rows(wide, keep_last=1, fed=np.array([2, 1]))  # row 0 reaches slot 15
    assert target.capacity == 32 and target.lengths.tolist() == [16, 8]


def test_the_cache_grows_and_shrinks_in_the_memory_it_has(llama_bundle, monkeypatch):
    """Shrinking the capacity, and growing it again up to the largest it has had, moves the
    rows within the memory the cache already holds (a fresh allocation faults every page in
    again: 40-60 ms for 16 demo rows), and every row's content survives each move."""
    from specrt.backends import rows

    monkeypatch.setattr(rows, "CAPACITY_STEP", 16)
    target = SpeculativeGenerator.from_bundle(llama_bundle, max_batch=3).target
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, target.vocab_size, n).tolist() for n in (5, 12, 9)]
    target.prefill_rows(0, prompts)
    step = np.array([[7], [8], [9]])

    def next_logits() -> np.ndarray:
        out = target.forward_rows(step, keep_last=1).logits[:, 0].copy()
        target.lengths[:] = [len(p) for p in prompts]
        return out

    def addresses() -> list[int]:
        return [buffer.__array_interface__["data"][0] for buffer in target._buffers]

    before = next_logits()
    target._grow(40)  # 48 positions: new memory, the largest yet
    where = addresses()
    np.testing.assert_allclose(next_logits(), before, rtol=0, atol=1e-5)
    target.shrink()
    assert target.capacity == 16 and addresses() == where
    np.testing.assert_allclose(next_logits(), before, rtol=0, atol=1e-5)
    target._grow(30)
    assert target.capacity == 32 and addresses() == where
    np.testing.assert_allclose(next_logits(), before, rtol=0, atol=1e-5)


def test_a_row_that_ran_alone_keeps_its_draft_window_once_batched(llama_bundle, monkeypatch):
    """A row running alone lets the hybrid's model skip ahead to a window of its context; once
    another row joins, the batched rounds go on reading the draft's cache as that window: the
    row's draft logits are those of a fresh decode of the window."""
    import specrt.runtime.batching as batching
    import specrt.runtime.hybrid as hybrid
    from specrt.runtime.schedules import LoadSchedule

    monkeypatch.setattr(hybrid, "DRAFT_WINDOW", 4)
    monkeypatch.setattr(batching, "DRAFT_WINDOW", 4)
    monkeypatch.setattr(planning, "DRAFT_WINDOW", 4)
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=2)
    reference = SpeculativeGenerator.from_bundle(llama_bundle, threads=1).draft
    draft = generator.draft
    runner = BatchRunner(
        generator.target, draft, generator.tokenizer, frozenset(), one_row=generator.one_row
    )

    class Drafts(LoadSchedule):  # batched rounds draft, so the draft reads the rows
        def _choose(self, rows: int, k_max: int) -> int:
            return 2

    runner.schedules["load"] = Drafts()
    config = GenerationConfig(
        max_new_tokens=40, ignore_eos=True, proposer="hybrid", draft_schedule="adaptive"
    )
    rng = np.random.default_rng(7)
    first, second = (rng.integers(3, draft.vocab_size, n).tolist() for n in (30, 9))
    runner.add([Request(0, first, config, np.random.default_rng(0))])
    row = runner.rows[0]
    while not row.round.offset:  # alone: the model skipped ahead
        assert not runner.step()
    runner.add([Request(1, second, config, np.random.default_rng(1))])
    runner.step()
    offset, seen = row.round.offset, int(draft.lengths[0])
    assert offset > 0 and 0 < seen <= 4 + 3
    reference.reset()
    reference.prefill(row.tokens[offset : offset + seen])
    expected = reference.forward(row.tokens[offset + seen : offset + seen + 1], keep_last=1)
    lengths = draft.lengths.copy()
    step = np.array([[row.tokens[offset + seen]], [0]])
    got = draft.forward_rows(step, keep_last=1).logits[0, -1]
    draft.lengths[:] = lengths
    np.testing.assert_allclose(got, expected.logits[-1], rtol=0, atol=1e-4)


def test_a_batched_row_far_ahead_of_the_draft_is_read_from_a_window(llama_bundle, monkeypatch):
    """After rounds without drafting (and prompts it skipped at admission), the draft starts
    over at each row's last `DRAFT_WINDOW` tokens rather than catching up on all of them (a
    proposer's context: the rows are still the target alone's)."""
    import specrt.runtime.batching as batching
    from specrt.runtime.schedules import LoadSchedule

    monkeypatch.setattr(batching, "DRAFT_WINDOW", 6)
    monkeypatch.setattr(planning, "DRAFT_WINDOW", 6)

    class Later(LoadSchedule):  # 5 rounds without drafting, then K = 2
        rounds = 0

        def _choose(self, rows: int, k_max: int) -> int:
            self.rounds += 1
            return 0 if self.rounds <= 5 else 2

    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    draft = generator.draft
    fed, prefill = [], draft.prefill_rows

    def recorded(start, pieces):
        fed.extend(len(piece) for piece in pieces)
        return prefill(start, pieces)

    draft.prefill_rows = recorded
    runner = BatchRunner(generator.target, draft, generator.tokenizer, frozenset())
    runner.schedules["load"] = Later()
    config = GenerationConfig(
        max_new_tokens=20, num_draft_tokens=3, draft_schedule="adaptive", ignore_eos=True,
        proposer="model",
    )  # fmt: skip
    ids = generator.encode_prompts(PROMPTS[:3])
    assert min(map(len, ids)) > 6
    results = dict(
        runner.run([Request(i, p, config, np.random.default_rng(i)) for i, p in enumerate(ids)])
    )
    assert fed and max(fed) == 6, fed  # each row's window, never its whole text
    alone = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    expected = alone.generate(PROMPTS[:3], replace(config, num_draft_tokens=0))
    assert [results[i].token_ids for i in range(3)] == [r.token_ids for r in expected]


def test_a_request_takes_text_and_its_seed_gives_its_stream(llama_bundle):
    """`Request(key, text, config)`: the prompt encoded as `generate` encodes it, the random
    stream keyed by the config's seed (no numpy Generator to build): the tokens are those of
    `generate` under the seed, and unseeded rows each draw their own."""
    from specrt import Request

    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    config = GenerationConfig(max_new_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    [expected] = generator.generate(["Simple is"], config)
    [ids] = generator.encode_prompts(["Simple is"])
    requests = [Request("text", "Simple is", config), Request("ids", ids, config)]
    got = dict(generator.run(requests))
    assert got["text"].token_ids == got["ids"].token_ids == expected.token_ids
    again = dict(generator.run(requests))  # the same Requests run again: the same stream
    assert again["text"].token_ids == again["ids"].token_ids == expected.token_ids
    with pytest.raises(InvalidInputError, match="request 'empty': the prompt is empty"):
        dict(generator.run([Request("empty", "", config)]))
    assert Request("x", "a").config == GenerationConfig()


def test_prompt_logprobs_are_the_targets_log_softmax_at_each_prompt_token(
    llama_bundle, monkeypatch
):
    """``prompt_logprobs``: each prompt token's log-probability after the tokens before it
    (None for the first), checked against one plain target pass, for a prompt longer than a
    chunk of its reading (16 here), a prompt two rows share and one that a finished row's cache
    holds: a row asking for them reads its whole prompt itself (nothing copied), and its tokens
    are the target alone's."""
    import specrt.runtime.round

    monkeypatch.setattr(specrt.runtime.round, "PREFILL_CHUNK", 16)
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=3)
    reference = SpeculativeGenerator.from_bundle(llama_bundle, threads=1).target
    long = [t for ids in generator.encode_prompts(PROMPTS[:8]) for t in ids][:60]
    short = generator.encode_prompts(PROMPTS[:1])[0]
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True, prompt_logprobs=2)
    generator.generate([long], replace(config, prompt_logprobs=None))  # kept: its cache holds it
    results = generator.generate([long, short, short], config)
    alone = generator.generate([long, short, short], replace(config, num_draft_tokens=0))
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]
    for prompt, result in zip([long, short, short], results):
        assert result.stats.cached_tokens == 0 and len(result.prompt_logprobs) == len(prompt)
        expected = log_softmax_after(reference, prompt[:-1], len(prompt) - 1)
        first, *rest = result.prompt_logprobs
        assert first is None and [entry.token for entry in rest] == prompt[1:]
        got = [entry.logprob for entry in rest]
        np.testing.assert_allclose(got, expected[np.arange(len(rest)), prompt[1:]], atol=1e-4)
        for entry, row in zip(rest, expected):
            assert [t for t, _ in entry.top] == np.argsort(-row, kind="stable")[:2].tolist()
    assert results[0].to_dict()["prompt_logprobs"][0] is None
    [plain] = generator.generate([long], replace(config, prompt_logprobs=None))
    assert plain.prompt_logprobs is None and plain.stats.cached_tokens > 0  # (copied, as ever)

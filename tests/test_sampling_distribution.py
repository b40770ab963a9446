"""End to end: tokens sampled by the speculative loop follow the target's warped distribution.

The exact marginal law of the 1st, 2nd and 3rd new token is computed from the target ONNX model
itself by enumerating every prefix (small vocabulary), and both the speculative loop and
target-only sampling are checked against it with a chi-square test.

The loop runs one row at a time and batched (8 rows per model call, rows accepting different
numbers of draft tokens), each path tested on its own. Rows without a seed are verified by
rejection sampling (each given its own stream here, so an outcome is reproducible); seeded rows
by their keyed draws, whose tokens are then also checked to be the target alone's, one for one.

False-alarm rate: each chi-square test rejects a correct sampler with probability ALPHA = 1e-4;
there are 4 settings x 3 positions x 2 modes x 2 paths = 48 tests without a seed, 4 settings x 3
positions x 2 paths = 24 seeded, and 2 settings x 3 positions x 4 cases through prompt lookup and
the hybrid = 24 more, so a correct implementation fails this module with probability at most
1e-2 (seeds are fixed, so a given outcome is reproducible).
"""

from __future__ import annotations

import numpy as np
import pytest

from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.batching import Request
from specrt.runtime.sampling import warp
from tests.conftest import build_bundle
from tests.stats import chi_square_pvalue

ALPHA = 1e-4
SAMPLES = 4000
# The draft model drafts every round (the default hybrid with the adaptive schedule may stop
# drafting on these tiny pairs): the rejection sampler's accept and reject paths both run.
MODEL_DRAFTS = dict(proposer="model", draft_schedule="fixed")
SETTINGS = [
    pytest.param(dict(temperature=1.0), id="t1.0"),
    pytest.param(dict(temperature=0.7, top_k=20), id="t0.7-topk20"),
    # hotter, so that min-p has tokens to drop (it keeps 1, 3, 7 where top-p alone keeps 2, 11, 26)
    pytest.param(dict(temperature=2.0, top_p=0.95, min_p=0.05), id="t2.0-topp0.95-minp0.05"),
    # the logits processors: the bias takes the best first token (5) from 0.998 to 0.5, the
    # penalties move each position's law by 0.75-0.99 in total variation x 2
    pytest.param(
        dict(
            temperature=1.0,
            logit_bias={5: -6.0},
            repetition_penalty=1.5,
            frequency_penalty=2.0,
            presence_penalty=1.0,
        ),
        id="bias-penalties",
    ),  # fmt: skip
]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return build_bundle(
        tmp_path_factory.mktemp("sampling"), "pair", arch="llama", seed=5, peak=45, draft_noise=0.45
    )


@pytest.fixture(scope="module")
def generator(bundle):
    """What users run: the onnxruntime engine graphs."""
    return SpeculativeGenerator.from_bundle(bundle, threads=1, engine="onnxruntime")


@pytest.fixture(scope="module")
def generators(generator, bundle):
    batched = SpeculativeGenerator.from_bundle(bundle, threads=1, max_batch=8)
    return {"one row": generator, "batched": batched}


@pytest.fixture(scope="module")
def reference(bundle):
    """The portable graph, batched without a cache: an independent route to the target's law."""
    return SpeculativeGenerator.from_bundle(bundle, threads=1, engine="portable")


def next_token_probs(
    reference, sequences: np.ndarray, settings: dict, prompt_length: int
) -> np.ndarray:
    """Warped target distribution after each row of ``sequences`` (one batched pass, no cache),
    their first ``prompt_length`` tokens the prompt (for the logits processors)."""
    spec, session = reference.target.spec, reference.target.session
    batch, length = sequences.shape
    empty = np.zeros((batch, spec.num_kv_heads, 0, spec.head_dim), np.float32)
    feed = {
        spec.io.input_ids: sequences.astype(np.int64),
        spec.io.attention_mask: np.ones((batch, length), np.int64),
        spec.io.position_ids: np.tile(np.arange(length), (batch, 1)),
    }
    feed.update({name: empty for name in spec.io.past_keys + spec.io.past_values})
    logits = session.run([spec.io.logits], feed)[0][:, -1, : reference.target.vocab_size]
    processors = GenerationConfig(**settings).processors
    if processors is not None:
        rows = [processors.apply(row[None], seq, prompt_length, []) for row, seq in
                zip(logits, sequences.tolist())]  # fmt: skip
        logits = np.concatenate(rows)
    temperature, top_k, top_p = (
        settings["temperature"],
        settings.get("top_k", 0),
        settings.get("top_p", 1),
    )
    return warp(logits, temperature, top_k, top_p, min_p=settings.get("min_p", 0))


def exact_marginals(reference, prompt: list[int], settings: dict) -> list[np.ndarray]:
    vocab = reference.target.vocab_size
    tokens = np.arange(vocab)
    length = len(prompt)
    p1 = next_token_probs(reference, np.array([prompt]), settings, length)[0]
    p2_given_1 = next_token_probs(
        reference, np.array([prompt + [t] for t in tokens]), settings, length
    )  # [t1, t2]
    m3 = np.zeros(vocab)
    for t1 in np.flatnonzero(p1):
        rows = np.array([prompt + [t1, t2] for t2 in tokens])
        p3 = next_token_probs(reference, rows, settings, length)  # [t2, t3]
        m3 += p1[t1] * (p2_given_1[t1] @ p3)
    return [p1, p1 @ p2_given_1, m3]


def sampled(generator, prompt: list[int], config: GenerationConfig, seed: int) -> list:
    """``SAMPLES`` rows of ``prompt``, row i drawing from the stream (seed, i)."""
    streams = [np.random.default_rng([seed, i]) for i in range(SAMPLES)]
    results = dict(generator.run(Request(i, prompt, config, rng) for i, rng in enumerate(streams)))
    return [results[i] for i in range(SAMPLES)]


def assert_follows(samples: np.ndarray, expected: list[np.ndarray], label: object) -> None:
    for position in range(3):
        counts = np.bincount(samples[:, position], minlength=len(expected[position]))
        pvalue = chi_square_pvalue(counts, expected[position])
        assert pvalue > ALPHA, (label, position, pvalue)


@pytest.mark.parametrize("path", ["one row", "batched"])
@pytest.mark.parametrize("settings", SETTINGS)
def test_sampled_tokens_follow_the_target(generators, reference, settings, path):
    generator = generators[path]
    prompt = generator.encode_prompts(["Simple is"])[0]
    expected = exact_marginals(reference, prompt, settings)
    for marginal in expected:
        assert np.isclose(marginal.sum(), 1.0)
        assert marginal.max() > 0.2  # peaked, not flat: the test has power
    for k in (0, 2):
        config = GenerationConfig(
            max_new_tokens=3, num_draft_tokens=k, ignore_eos=True, **MODEL_DRAFTS, **settings
        )
        results = sampled(generator, prompt, config, 100 + k)
        samples = np.array([r.token_ids for r in results])
        assert samples.shape == (SAMPLES, 3)
        if k:
            drafted = sum(r.stats.drafted_tokens for r in results)
            accepted = sum(r.stats.accepted_tokens for r in results)
            assert 0.2 < accepted / drafted < 0.95  # both accept and reject paths are exercised
        assert_follows(samples, expected, k)


@pytest.mark.parametrize("path", ["one row", "batched"])
@pytest.mark.parametrize("settings", SETTINGS)
def test_seeded_tokens_follow_the_target_and_are_the_target_alones(
    generators, reference, settings, path
):
    """Seeded rows (keyed draws): the target alone's tokens follow its law, and the
    speculative loop's are those very tokens, row for row."""
    generator = generators[path]
    prompt = generator.encode_prompts(["Simple is"])[0]
    expected = exact_marginals(reference, prompt, settings)
    tokens = {}
    for k, rows in ((0, SAMPLES), (2, SAMPLES // 4)):  # row i: the stream (100, i) either way
        config = GenerationConfig(
            max_new_tokens=3,
            num_draft_tokens=k,
            seed=100,
            ignore_eos=True,
            **MODEL_DRAFTS,
            **settings,
        )
        results = generator.generate([prompt] * rows, config)
        tokens[k] = np.array([r.token_ids for r in results])
        if k:
            drafted = sum(r.stats.drafted_tokens for r in results)
            accepted = sum(r.stats.accepted_tokens for r in results)
            assert 0.2 < accepted / drafted < 0.95  # drafts kept and drafts refused
    assert_follows(tokens[0], expected, "seeded")
    assert (tokens[2] == tokens[0][: SAMPLES // 4]).all()


def test_same_seed_same_output(generator):
    prompts = ["Simple is", "def f"]
    config = GenerationConfig(max_new_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
    first = [r.token_ids for r in generator.generate(prompts, config)]
    assert first == [r.token_ids for r in generator.generate(prompts, config)]
    other = GenerationConfig(max_new_tokens=16, temperature=1.0, seed=43, ignore_eos=True)
    assert first != [r.token_ids for r in generator.generate(prompts, other)]


MATCH_CASES = [
    pytest.param("one row", "lookup", id="one-row-lookup"),
    pytest.param("batched", "lookup", id="batched-lookup"),
    pytest.param("one row", "hybrid", id="one-row-hybrid"),
    pytest.param("batched", "hybrid", id="batched-hybrid"),
]


@pytest.mark.parametrize(("path", "proposer"), MATCH_CASES)
@pytest.mark.parametrize("settings", SETTINGS[:2])
def test_sampled_tokens_follow_the_target_through_matches(
    generators, bundle, reference, settings, path, proposer, monkeypatch
):
    """Prompt lookup and the hybrid propose point masses (the prompt repeats itself, so matches
    fire from the first round on): the emitted tokens still follow the target exactly. (The
    hybrid, one row or batched, is told to verify every match whole, and a lone row's guard to
    allow them: left to themselves they verify them as often as their timings say they pay,
    and a guard's probes verify a match's first token only, which is nearly always kept.)"""
    from specrt.runtime.hybrid import HybridChoice
    from specrt.runtime.schedules import LoadSchedule
    from specrt.runtime.schedules.guard import UNCAPPED, SpeculationGuard

    monkeypatch.setattr(HybridChoice, "match_length", lambda self, found, *_: len(found.tokens))
    monkeypatch.setattr(SpeculationGuard, "caps", lambda self: (UNCAPPED, UNCAPPED))

    class EveryMatch(LoadSchedule):
        def match_option(self, rows, curves, probe=False):
            return max(map(len, curves), default=0), 1e9  # beats any model draft

    generator = generators[path]
    if (path, proposer) == ("batched", "hybrid"):
        generator = SpeculativeGenerator.from_bundle(bundle, threads=1, max_batch=8)
        generator._load_schedules["load"] = EveryMatch()
    # "Simple is", the target's greedy continuation, "Simple is" again: the lookup proposes the
    # continuation, which the target (peaked) often but not always takes again.
    start = generator.encode_prompts(["Simple is"])[0]
    greedy = GenerationConfig(max_new_tokens=4, num_draft_tokens=0, ignore_eos=True)
    prompt = start + generator.generate([start], greedy)[0].token_ids + start
    expected = exact_marginals(reference, prompt, settings)
    # The schedule `specrt batch` uses: a fixed K makes a hybrid row verify its match only
    # where it is expected to keep more than K model tokens (here it never is)
    schedule = "adaptive" if proposer == "hybrid" else "fixed"
    config = GenerationConfig(
        max_new_tokens=3, num_draft_tokens=2, ignore_eos=True, proposer=proposer,
        draft_schedule=schedule, **settings,
    )  # fmt: skip
    results = sampled(generator, prompt, config, 7)
    proposed = sum(e["proposed"] for r in results for e in r.stats.proposers.values())
    matched = sum(r.stats.proposers.get("lookup", {}).get("proposed", 0) for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert matched > SAMPLES // 2  # the matches fired (the first token is the target's alone)
    assert 0.1 < accepted / proposed < 0.95  # both accept and reject paths are exercised
    assert_follows(np.array([r.token_ids for r in results]), expected, proposer)

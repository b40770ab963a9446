"""Proposers without a draft model (prompt lookup, the suffix cache) and the hybrid: the
point-mass verification rule by exact enumeration, the matchers against brute force, the suffix
cache's bound and privacy, and greedy output identical to the target alone's for every proposer
and architecture, one row and batched."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import specrt.runtime.batching as batching
import specrt.runtime.planning as planning
from specrt.backends import Forward, base
from specrt.errors import InvalidInputError
from specrt.export import SUPPORTED_MODEL_TYPES
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.batching import BatchRunner, Request
from specrt.runtime.hybrid import NO_MATCH_YET, HybridChoice, MatchAcceptance, outcome
from specrt.runtime.lookup import NgramIndex, Proposal, SuffixCache
from specrt.runtime.service import Service
from specrt.runtime.verification import verify
from tests.test_verification import PLAIN, Branches, V, _random, branches  # noqa: F401

# --- the point-mass rule, by exact enumeration of `verify` ------------------------------------


def point_mass_law(branches, p, x, bonus) -> np.ndarray:  # noqa: F811
    """P(first emitted token = y) when the proposer deterministically proposes x."""
    law = np.zeros_like(p)

    def run(rng):
        accepted, token = verify(
            [x], None, Forward(np.zeros((2, V)), np.stack([p, bonus])), PLAIN, rng
        )
        return ([x][:accepted] + [token])[0]

    for emitted, chance in branches.outcomes(run).items():
        law[emitted] += chance
    return law


def _point_mass_cases():
    rng = np.random.default_rng(99)
    cases = []
    for i in range(10):
        p = _random(rng, zeros=i % 3)
        cases.append((f"inside{i}", p, int(np.flatnonzero(p)[i % np.count_nonzero(p)])))
        if (p == 0).any():
            cases.append((f"outside{i}", p, int(np.flatnonzero(p == 0)[0])))
    cases.append(("p_one_hot_at_x", np.eye(V)[3], 3))
    cases.append(("p_one_hot_elsewhere", np.eye(V)[3], 1))
    return cases


@pytest.mark.parametrize(("name", "p", "x"), _point_mass_cases(), ids=lambda v: str(v)[:14])
def test_point_mass_emits_exactly_p(name, p, x, branches):  # noqa: F811
    bonus = _random(np.random.default_rng(1))
    assert np.abs(point_mass_law(branches, p, x, bonus) - p).max() < 1e-9, name


def test_point_mass_then_model_token_joint_is_exact(branches):  # noqa: F811
    """A chain: a matched token (point mass) then a model token drawn from q: the joint law of
    the first two emitted tokens is the target's."""
    rng = np.random.default_rng(5)
    for _ in range(5):
        p1 = _random(rng, zeros=1)
        p2 = {y: _random(rng, zeros=y % 2) for y in range(V)}
        q2 = {y: _random(rng, zeros=(y + 1) % 3) for y in range(V)}
        bonus = _random(rng)
        x1 = int(rng.integers(V))
        joint = np.zeros((V, V))
        for x2 in np.flatnonzero(q2[x1]):
            rows = np.stack([p1, p2[x1], bonus])

            def run(rng, drafted=(x1, int(x2)), q=q2[x1], rows=rows):
                accepted, token = verify(drafted, [None, q], Forward(0 * rows, rows), PLAIN, rng)
                return (*drafted[:accepted], token)

            for emitted, chance in branches.outcomes(run).items():
                weight = q2[x1][x2] * chance
                if len(emitted) >= 2:
                    joint[emitted[0], emitted[1]] += weight
                else:
                    joint[emitted[0]] += weight * p2[emitted[0]]
        expected = p1[:, None] * np.stack([p2[y] for y in range(V)])
        assert np.abs(joint - expected).max() < 1e-9


def test_point_mass_enumeration_can_fail(branches, monkeypatch):  # noqa: F811
    """Emitting from p itself (x not removed) after a rejection moves the law off p."""
    from specrt.runtime import verification

    p = _random(np.random.default_rng(3))
    monkeypatch.setattr(verification, "without", lambda p_i, x: p_i)
    assert np.abs(point_mass_law(branches, p, 2, p) - p).max() > 1e-3


# --- the matchers ---------------------------------------------------------------------------


def brute_force_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The continuation of the latest earlier occurrence of the longest suffix n-gram."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):  # occurrences followed by a token
            if tokens[start : start + n] == suffix:
                out, position = [], start + n
                period = end - position
                while len(out) < k:
                    out.append(tokens[position] if position < end else out[len(out) - period])
                    position += 1
                return out
    return []


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 3), (2, 4), (1, 1)])
def test_ngram_index_matches_brute_force(min_n, max_n):
    rng = np.random.default_rng(min_n * 10 + max_n)
    for trial in range(30):
        tokens = rng.integers(0, 4 + trial % 5, size=int(rng.integers(2, 60))).tolist()
        index = NgramIndex(min_n, max_n)
        for end in range(1, len(tokens) + 1):  # grown one token at a time
            got = index.propose(tokens[:end], 5).tokens
            assert got == brute_force_lookup(tokens[:end], 5, min_n, max_n), (tokens[:end], got)
        index, end = NgramIndex(min_n, max_n), int(rng.integers(1, len(tokens) + 1))
        while end <= len(tokens):  # a prompt at once, then rounds of several tokens
            got = index.propose(tokens[:end], 5).tokens
            assert got == brute_force_lookup(tokens[:end], 5, min_n, max_n), (tokens[:end], got)
            end += int(rng.integers(1, 8))
    # (a fresh index per sequence: one index follows one growing row)
    assert NgramIndex(1, 3).propose([7, 8, 9, 1, 7, 8], 3).tokens == [9, 1, 7]  # the longest
    assert NgramIndex(1, 3).propose([5, 6, 5, 6, 5], 4).tokens == [6, 5, 6, 5]  # loops on
    assert NgramIndex(1, 3).propose([1, 2, 3], 3).tokens == []  # no token repeats


def test_a_match_says_whether_it_continues_the_rows_own_output():
    """A row repeating its own output goes on far more often than one following its prompt:
    the hybrid learns the two apart (CHANGELOG.md, 2026-12-02), so a match says which it
    continues."""
    prompt = [1, 2, 3, 4, 1, 2]  # its first match (at this length) continues the prompt
    index = NgramIndex(1, 3)
    found = index.propose(prompt, 2)
    assert found.tokens == [3, 4] and not found.from_output
    row = prompt + [9, 8, 7, 9, 8]  # then the row generates a loop of its own
    found = index.propose(row, 2)
    assert found.tokens == [7, 9] and found.from_output
    index.reset()  # a new row: its prompt is what it has at its first lookup
    assert not index.propose(row, 2).from_output
    index.reset()  # unless told (a batched row's first lookup may come rounds later)
    index.prompt_length = len(prompt)
    assert index.propose(row, 2).from_output
    acceptance = MatchAcceptance()
    own = Proposal([1, 2, 3, 4], 2, "lookup", from_output=True)
    follows = Proposal([1, 2, 3, 4], 2, "lookup", from_output=False)
    for _ in range(20):
        acceptance.record(own, 2, 4, 4)
        acceptance.record(follows, 2, 4, 0)
    assert (
        acceptance.expected_tokens(own, 2)[-1]
        > 4
        > 1.5
        > acceptance.expected_tokens(follows, 2)[-1]
    )


def test_a_matchs_expected_tokens_follow_every_record_and_length():
    """Curves are kept per key between records (a batch's rows ask every round): what is
    asked after a record, or for a longer match, is what counts learnt afresh give."""
    kept, fresh = MatchAcceptance(), MatchAcceptance()
    short, long = Proposal([1, 2], 2, "lookup"), Proposal(list(range(12)), 2, "lookup")
    for accepted in (2, 0, 1, 2):
        assert kept.expected_tokens(short, 2) == fresh.expected_tokens(short, 2)
        assert kept.expected_tokens(long, 2) == fresh.expected_tokens(long, 2)
        assert len(kept.expected_tokens(long, 2)) == 12
        for acceptance in (kept, fresh):
            acceptance.record(short, 2, 2, accepted)
        fresh = MatchAcceptance()  # the same counts, nothing asked of it yet
        fresh.counts = {key: [list(c) for c in row] for key, row in kept.counts.items()}
    assert kept.expected_tokens(short, 2) != MatchAcceptance().expected_tokens(short, 2)


def test_suffix_cache_proposes_the_most_frequent_continuation():
    cache = SuffixCache(max_tokens=1000, depth=3)
    for document in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 9], [7, 2, 3, 5]):
        cache.add(document)
    found = cache.propose([8, 1, 2, 3], 2)
    assert (found.tokens, found.match, found.source) == ([4], 3, "suffix")
    assert cache.propose([0, 0], 3).tokens == []


def test_suffix_cache_is_bounded_and_forgets_exactly():
    rng = np.random.default_rng(0)
    cache = SuffixCache(max_tokens=2000, depth=4)
    sizes = []
    documents = [rng.integers(0, 50, size=int(rng.integers(20, 200))).tolist() for _ in range(300)]
    for i, document in enumerate(documents):
        cache.add(document)
        assert cache.tokens <= 2000
        if i >= 100:
            sizes.append(cache.memory_bytes())
    assert max(sizes) < 1.5 * min(sizes)  # a long run does not grow it
    # What it holds is exactly what a cache built from the kept documents alone holds.
    fresh = SuffixCache(max_tokens=2000, depth=4)
    for document in cache._documents:
        fresh.add(document)
    assert fresh._counts == cache._counts


@pytest.mark.parametrize("document", [None, "abc", [-1, 5], [1.5, 2.5], [True, False], 7])
def test_a_suffix_cache_takes_token_ids_alone(document):
    """Anything else failed deep inside (None) or was learnt in silence (text, negatives)."""
    cache = SuffixCache(max_tokens=100, depth=3)
    with pytest.raises(InvalidInputError, match="a suffix cache learns a list of token ids"):
        cache.add(document)
    cache.add(np.array([1, 2, 3, 1, 2, 4]))  # numpy's ids are ids
    assert len(cache) and cache.propose([1, 2], 1).tokens in ([3], [4])


# --- generation: greedy output is the target's, for every proposer --------------------------

REPEATS = [
    "def f(x):\n    return x\ndef f(x):\n    return",
    "a b c a b c a b c a b",
    "for i in range(10):\n    for i in range(10):\n        for i in",
]
PLAIN_PROMPTS = ["Simple is", "better than", "x"]
PROPOSERS = [
    dict(proposer="lookup", draft_schedule="fixed"),
    dict(proposer="lookup", draft_schedule="fixed", prompt_lookup_min=2, prompt_lookup_max=4),
    dict(proposer="hybrid", draft_schedule="fixed"),
    dict(proposer="hybrid", draft_schedule="adaptive", num_draft_tokens=8),
]


def generate(generator, k: int = 4, extra: list[list[int]] = (), **options):
    options.setdefault("num_draft_tokens", k)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True, **options)
    return generator.generate(REPEATS + PLAIN_PROMPTS + list(extra), config)


def trap_prompt(generator) -> list[int]:
    """Token ids whose lookup match a target that repeats the prompt's last token rejects (a
    tiny random model may): ``t t u v t``, then ``t``: "t t" was followed by u."""
    vocab = generator.target.vocab_size
    t = generator.encode_prompts(["x"])[0][-1]
    return [t, t, (t + 1) % vocab, (t + 2) % vocab, t]


@pytest.mark.parametrize("arch", SUPPORTED_MODEL_TYPES)
def test_every_proposer_greedy_equals_target_only(bundles, arch):
    one_row = SpeculativeGenerator.from_bundle(bundles[arch], threads=1)
    batched = SpeculativeGenerator.from_bundle(bundles[arch], threads=1, max_batch=4)
    # A suffix cache that already holds other rows' text (the plain prompts' outputs).
    cached = SpeculativeGenerator(
        batched.target, batched.draft, batched.tokenizer, batched.eos_token_ids, SuffixCache()
    )
    cached.generate(PLAIN_PROMPTS[::-1], GenerationConfig(max_new_tokens=60, ignore_eos=True))
    trap = [trap_prompt(one_row)]
    expected = [r.token_ids for r in generate(one_row, 0, trap)]
    # A target that repeats one token (tiny Gemma) gives every row its own match from its
    # first new token on, so the suffix cache is never asked, and only the trap's match fails
    repeats = all(len(set(ids)) == 1 for ids in expected)
    for options in PROPOSERS:
        for generator in (one_row, batched, cached):
            generator._hybrids.clear()
            generator._load_schedules.clear()
            results = generate(generator, extra=trap, **options)
            assert [r.token_ids for r in results] == expected, (arch, options, generator.max_batch)
            sources = {s for r in results for s in r.stats.proposers}
            proposed = sum(e["proposed"] for r in results for e in r.stats.proposers.values())
            accepted = sum(e["accepted"] for r in results for e in r.stats.proposers.values())
            # The matches fired, and some were rejected; not always with a hybrid on a
            # repeating target: whether its rounds take the matches or the model's drafts (all
            # kept there too) is decided by measured speed (the output is the same either way)
            if not (repeats and options["proposer"] == "hybrid"):
                assert "lookup" in sources, (arch, options)
                assert accepted < proposed, (arch, options)
            if generator is cached and not repeats:
                assert "suffix" in sources, (arch, options)
            assert 0 < accepted, (arch, options)
            for result in results:
                stats = result.stats
                assert stats.accepted_tokens == sum(e["accepted"] for e in stats.proposers.values())
                assert stats.new_tokens == stats.accepted_tokens + stats.rounds


def test_suffix_cache_off_leaks_nothing_across_requests(llama_bundle):
    """Without a suffix cache, a request's proposals are the same whatever ran before it; with
    one, an earlier request's text is proposed (so the check can fail). The fixed schedule:
    the adaptive one's guard learns from every request's timings, by design."""
    earlier = "q w e r t y u i o p q w e r t y u i o p"
    later = "z q w e r"
    config = GenerationConfig(
        max_new_tokens=24, num_draft_tokens=4, proposer="lookup", draft_schedule="fixed"
    )

    def stats_of_later(generator, first: bool):
        if first:
            generator.generate([earlier], config)
        return generator.generate([later], config)[0].stats.proposers

    for max_batch in (1, 4):
        private = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=max_batch)
        alone = stats_of_later(private, first=False)
        assert stats_of_later(private, first=True) == alone
        assert private.suffix_cache is None
        shared = SpeculativeGenerator.from_bundle(
            llama_bundle, threads=1, max_batch=max_batch, suffix_cache=SuffixCache()
        )
        assert "suffix" in stats_of_later(shared, first=True)
        assert shared.suffix_cache.documents_added == 2
    # The same through a Service (what `specrt serve --suffix-cache` runs): off by default.
    for cache in (None, SuffixCache()):
        generator = SpeculativeGenerator.from_bundle(
            llama_bundle, threads=1, max_batch=4, suffix_cache=cache
        )
        with Service(generator) as service:
            service.submit(earlier, config).result(timeout=60)
            later_stats = service.submit(later, config).result(timeout=60).stats.proposers
        assert ("suffix" in later_stats) == (cache is not None), later_stats
        assert cache is None or cache.documents_added == 2


def test_the_first_pass_takes_the_prompts_end_and_a_free_match(llama_bundle, monkeypatch):
    """A row's first token comes from one pass over what the prefill (whole chunks) left of the
    prompt, not a pass of its own, and that pass also verifies a match where the hybrid finds
    one worth it and it fits in a chunk (no model runs for it): the output stays the
    target's."""
    chunk = 16  # prefill chunks (PREFILL_CHUNK, 256) that fit the tiny model's 128 positions
    monkeypatch.setattr(base, "PREFILL_CHUNK", chunk)
    monkeypatch.setattr(batching, "PREFILL_CHUNK", chunk)
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    target, fed = generator.target, []
    call, forward = target._call, target.forward

    def counted_rows(start, n, tokens, *args, **kwargs):
        fed.append(tokens.shape[1])
        return call(start, n, tokens, *args, **kwargs)

    def counted(tokens, *args, **kwargs):
        fed.append(len(tokens))
        return forward(tokens, *args, **kwargs)

    target._call, target.forward = counted_rows, counted  # the prefill's chunks: rows calls
    short = generator.encode_prompts([REPEATS[1]])[0][: chunk - 4]
    long = (short * 4)[: chunk + 5]
    alone = GenerationConfig(max_new_tokens=6, ignore_eos=True, num_draft_tokens=0)
    hybrid = GenerationConfig(max_new_tokens=6, ignore_eos=True, proposer="hybrid")
    full = (short * 8)[: 2 * chunk]  # its rest fills a chunk: no room for a match
    for prompt, prefilled in ((short, []), (long, [chunk]), (full, [chunk])):
        rest = len(prompt) - sum(prefilled)
        fed.clear()
        target.reset()  # each call reads its prompt (not a finished row's kept copy)
        [expected] = generator.generate([prompt], alone)
        assert fed == prefilled + [rest] + [1] * 5  # one pass per new token, the first one too
        fed.clear()
        target.reset()
        generator._hybrids.clear()  # priors only: what it learns from timing varies
        [result] = generator.generate([prompt], hybrid)
        assert result.token_ids == expected.token_ids
        first = fed[len(prefilled)]
        if prompt is full:  # one call feeds at most a chunk (TensorRT plans' profiles)
            assert first == rest == chunk
            continue
        assert first > rest  # a match too
        assert result.stats.proposers["lookup"]["proposed"] >= first - rest


def test_a_hybrids_model_reads_a_window_of_a_long_context(llama_bundle, monkeypatch):
    """The hybrid's model, asked to draft after skipping a long prompt, reads only its last
    `DRAFT_WINDOW` tokens (the output stays the target's, a seeded row's too)."""
    import specrt.runtime.hybrid as hybrid

    window = 6
    for module in (hybrid, batching, planning):
        monkeypatch.setattr(module, "DRAFT_WINDOW", window)
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    draft, fed = generator.draft, []
    call = draft._call

    def counted(start, n, tokens, *args, **kwargs):
        fed.append(tokens.shape[1])
        return call(start, n, tokens, *args, **kwargs)

    draft._call = counted
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, generator.target.vocab_size, 40).tolist()  # nothing to match
    [expected] = generator.generate(
        [prompt], GenerationConfig(max_new_tokens=16, ignore_eos=True, num_draft_tokens=0)
    )
    hybrid_config = dict(max_new_tokens=16, ignore_eos=True, proposer="hybrid")
    [result] = generator.generate([prompt], GenerationConfig(**hybrid_config))
    assert result.token_ids == expected.token_ids
    assert result.stats.proposers["model"]["proposed"] > 0  # the model drafted
    assert max(fed) == window  # its first catch-up: the window, not the prompt
    assert draft.length < len(prompt)
    fed.clear()
    seeded = GenerationConfig(**hybrid_config, temperature=1.0, seed=3)
    [result] = generator.generate([prompt], seeded)
    assert max(fed) == window
    target_alone = replace(seeded, num_draft_tokens=0, proposer="model")
    assert result.token_ids == generator.generate([prompt], target_alone)[0].token_ids


def test_a_rows_first_match_is_learnt_apart_from_one_after_a_miss(llama_bundle):
    """A row's first match (often its prompt's own repeat) is kept far more often than one
    right after the target left a copy: learnt as one (both were history 0), the first ones
    had the hybrid verify long matches again right after a miss (CHANGELOG.md, 2026-12-02).
    Both the one-row hybrid and a batched row start with no match yet."""
    acceptance = MatchAcceptance()
    found = Proposal(list(range(8)), 3, "lookup")
    for _ in range(20):
        acceptance.record(found, NO_MATCH_YET, 8, 8)  # first matches: all kept
        acceptance.record(found, outcome(8, 0), 8, 0)  # after a miss: none
    assert acceptance.expected_tokens(found, NO_MATCH_YET)[-1] > 7
    assert acceptance.expected_tokens(found, outcome(8, 0))[-1] < 1.5
    assert NO_MATCH_YET not in {outcome(8, accepted) for accepted in range(9)}

    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    config = GenerationConfig(proposer="hybrid", max_new_tokens=4)
    hybrid = generator.one_row(config).hybrid
    assert isinstance(hybrid, HybridChoice)  # shared by rows: each row's history is passed in
    hybrid.acceptance = acceptance
    assert hybrid.match_length(found, NO_MATCH_YET) > hybrid.match_length(found, outcome(8, 0))
    runner = BatchRunner(generator.target, generator.draft, None, frozenset())
    request = Request(0, [5, 6, 7], config, np.random.default_rng(0))
    row = runner._new_row(request)
    assert row.match_history == NO_MATCH_YET and row.index.prompt_length == 3

"""Greedy speculative output equals target-only greedy output, token for token."""

from __future__ import annotations

import pytest

from specrt.export import ENGINE_MODEL_TYPES, SUPPORTED_MODEL_TYPES
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from tests.conftest import build_bundle

WORDS = ["Simple", "is", "better", "than", "def", "fibonacci(n):", "for", "i", "in", "range(10)"]
PROMPTS = [
    " ".join(WORDS[i % 10 : i % 10 + 1 + i % 4]) + ("\n" if i % 3 == 0 else "") for i in range(20)
]


def run(generator, k: int, **options):
    options = {"proposer": "model", "draft_schedule": "fixed", **options}  # the draft model's
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=k, **options)
    return generator.generate(PROMPTS, config)


ARCH_ENGINES = [(arch, "portable") for arch in SUPPORTED_MODEL_TYPES]
ARCH_ENGINES += [(arch, "onnxruntime") for arch in ENGINE_MODEL_TYPES]


@pytest.mark.parametrize(("arch", "engine"), ARCH_ENGINES)
def test_speculative_greedy_equals_target_only(bundles, arch, engine):
    generator = SpeculativeGenerator.from_bundle(bundles[arch], threads=1, engine=engine)
    for ignore_eos in (False, True):
        baseline = run(generator, 0, ignore_eos=ignore_eos)
        assert all(r.stats.drafted_tokens == 0 for r in baseline)
        # The schedules are the runtime's, not the graph's: the portable graph (rolled back
        # through its mask and positions) is checked at a short and a long draft.
        schedules = [(k, "fixed") for k in ((1, 4) if engine == "portable" else (1, 2, 4, 8))]
        if engine != "portable":
            schedules += [(8, "adaptive"), (8, "heuristic")]
        for k, schedule in schedules:
            # The adaptive controller persists per generator; on these tiny pairs the draft costs
            # as much as the target, so after its first rounds it rightly stops drafting. A
            # fresh one drafts while it learns, which is the path to check here.
            generator._schedules.clear()
            results = run(generator, k, ignore_eos=ignore_eos, draft_schedule=schedule)
            for prompt, spec, base in zip(PROMPTS, results, baseline):
                assert spec.token_ids == base.token_ids, (arch, k, prompt)
                assert spec.finish_reason == base.finish_reason
                assert spec.text == base.text
            drafted = sum(r.stats.drafted_tokens for r in results)
            accepted = sum(r.stats.accepted_tokens for r in results)
            # Both paths of the verifier ran: some drafts rejected, some accepted. (How much the
            # adaptive controller drafts depends on measured times: it only has to draft.)
            if schedule == "adaptive":
                assert drafted > 0, (arch, accepted, drafted)
            else:
                assert 0 < accepted < drafted, (arch, k, accepted, drafted)
        # A fully accepted round (bonus token; the draft then catches up on two tokens) happened.
        assert any(r.stats.accepted_per_position[-1] > 0 for r in run(generator, 2))


@pytest.mark.parametrize("arch", ENGINE_MODEL_TYPES)
def test_engine_output_equals_portable_output(bundles, arch):
    """The onnxruntime engine (fused graph, in-place cache) decodes what the portable graph does."""
    outputs = {}
    for engine in ("portable", "onnxruntime"):
        generator = SpeculativeGenerator.from_bundle(bundles[arch], threads=1, engine=engine)
        outputs[engine] = [r.token_ids for r in run(generator, 0, ignore_eos=True)]
    assert outputs["onnxruntime"] == outputs["portable"]


def test_stats_are_consistent(llama_generator):
    for result in run(llama_generator, 4, ignore_eos=True):
        stats = result.stats
        assert stats.new_tokens == len(result.token_ids) == 32
        assert stats.new_tokens == stats.accepted_tokens + stats.rounds
        assert stats.acceptance_rate == pytest.approx(stats.accepted_tokens / stats.drafted_tokens)
        assert stats.mean_accepted_tokens == pytest.approx(stats.accepted_tokens / stats.rounds)
        assert stats.tokens_per_round == pytest.approx(stats.new_tokens / stats.rounds)
        assert sum(stats.accepted_per_position) == stats.accepted_tokens
        counts = stats.accepted_per_position
        assert all(a >= b for a, b in zip(counts, counts[1:]))  # position i+1 needs position i
        for entry in stats.proposers.values():  # positions 0..K-1 however far one got
            assert len(entry["accepted_per_position"]) == len(counts)
        assert stats.tokens_per_second > 0 and stats.wall_time_s > 0


def test_max_positions_stop_matches_target_only(tmp_path):
    """Generation stops at the model's max positions ('length'), with identical output; a draft
    with fewer positions than the target simply stops drafting near its limit."""
    bundle = build_bundle(tmp_path, "short", arch="llama", max_positions=40, draft_noise=0.3)
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    config = dict(max_new_tokens=100, ignore_eos=True)
    [base] = generator.generate([PROMPTS[1]], GenerationConfig(num_draft_tokens=0, **config))
    [spec] = generator.generate([PROMPTS[1]], GenerationConfig(num_draft_tokens=8, **config))
    assert base.finish_reason == spec.finish_reason == "length"
    assert base.stats.prompt_tokens + len(base.token_ids) == 40
    assert spec.token_ids == base.token_ids


def test_draft_with_fewer_positions(tmp_path):
    bundle = build_bundle(
        tmp_path, "shortdraft", arch="llama", max_positions=64, draft_max_positions=20
    )
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    config = dict(max_new_tokens=60, ignore_eos=True)
    [base] = generator.generate([PROMPTS[1]], GenerationConfig(num_draft_tokens=0, **config))
    [spec] = generator.generate([PROMPTS[1]], GenerationConfig(num_draft_tokens=4, **config))
    assert spec.token_ids == base.token_ids
    assert len(spec.token_ids) == 64 - spec.stats.prompt_tokens
    assert spec.stats.drafted_tokens < 4 * spec.stats.rounds  # drafting stopped at the draft's end


def test_threads_sharing_a_generator_get_target_only_output(llama_generator):
    """Rows from several threads are serialised: each gets exactly its own output."""
    from concurrent.futures import ThreadPoolExecutor

    expected = [r.token_ids for r in run(llama_generator, 0, ignore_eos=True)]
    config = GenerationConfig(max_new_tokens=32, num_draft_tokens=4, ignore_eos=True)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: llama_generator.generate([p], config)[0].token_ids, PROMPTS))
    assert got == expected

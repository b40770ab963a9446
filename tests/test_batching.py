"""Batched generation: rows of different lengths share every model call, accept different numbers
of draft tokens, finish at different rounds and are replaced by waiting rows; each row's output
is what it would be alone."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.export import SUPPORTED_MODEL_TYPES
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.batching import Request
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
    random tiny models seldom emit their EOS, so a token they often emit stands in for it:
    rows then stop at EOS at different rounds, others run to their length."""
    out = {}
    for arch in SUPPORTED_MODEL_TYPES:
        generator = SpeculativeGenerator.from_bundle(bundles[arch], threads=1)
        out[arch, True] = run_all(generator, varied(0, ignore_eos=True))
        emitted = np.concatenate([r.token_ids for r in out[arch, True].values()])
        out[arch, "eos"] = frozenset([int(np.bincount(emitted).argmax())])
        generator.eos_token_ids = out[arch, "eos"]
        out[arch, False] = run_all(generator, varied(0, ignore_eos=False))
    return out


@pytest.mark.parametrize("arch", SUPPORTED_MODEL_TYPES)
def test_batched_greedy_equals_target_alone(bundles, alone, arch):
    for batch in (2, 4, 8):  # 20 prompts: rows are refilled as others finish
        generator = SpeculativeGenerator.from_bundle(bundles[arch], threads=1, max_batch=batch)
        assert generator.max_batch == batch
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


def test_a_seeded_row_is_the_same_whatever_shares_its_batch(llama_bundle):
    """Each row samples from its own stream: its tokens do not depend on the batch size or on
    its neighbours (other prompts, other settings, greedy rows, rows finishing early)."""
    seeded = GenerationConfig(max_new_tokens=24, temperature=1.0, num_draft_tokens=3, seed=7)
    neighbours = [
        GenerationConfig(max_new_tokens=3 + i, temperature=0.6 + 0.1 * i, top_k=5 * i, seed=i)
        for i in range(4)
    ] + [GenerationConfig(max_new_tokens=9, num_draft_tokens=2)]
    outputs = []
    for batch, order in ((1, 0), (3, 1), (8, 2)):
        generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=batch)
        ids = generator.encode_prompts(PROMPTS)
        mine = [Request(("mine", i), ids[i], seeded, np.random.default_rng([7, i])) for i in (0, 5)]
        others = [
            Request(("other", j), ids[(j * 3 + order) % len(ids)], config, np.random.default_rng(j))
            for j, config in enumerate(neighbours)
        ]
        mixed = others[order:] + mine[:1] + others[:order] + mine[1:]
        results = dict(generator.run(mixed))
        outputs.append({key: results[key].token_ids for key in (("mine", 0), ("mine", 5))})
    assert outputs[0] == outputs[1] == outputs[2]
    assert outputs[0][("mine", 0)] != outputs[0][("mine", 5)]


def test_the_load_schedule_can_stop_drafting(llama_bundle):
    """On these tiny pairs the draft costs about what the target does: drafting never pays, and
    the load schedule, having measured every K, settles on K = 0 for most rounds."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    config = GenerationConfig(max_new_tokens=40, num_draft_tokens=4, draft_schedule="adaptive")
    generator.generate(PROMPTS * 3, config)
    schedule = generator._load_schedules["load"]
    measured = {k for rows, k in schedule.seconds if rows == 4}
    assert measured == {0, 1, 2, 3, 4}
    best = max(range(5), key=lambda k: schedule.expected_tokens(k) / schedule.seconds[4, k])
    assert schedule.choose(4, 4) in (best, best - 1, best + 1)


def test_batch_size_is_checked(llama_bundle):
    from specrt.errors import InvalidInputError

    for bad in (0, -1, 2.5, "4", True):
        with pytest.raises(InvalidInputError, match="max_batch"):
            SpeculativeGenerator.from_bundle(llama_bundle, max_batch=bad)

"""The logits processors (``logit_bias``, the repetition, frequency and presence penalties):
their math against its definition, and greedy decoding with them, speculative or not, against
a decode written out here over the portable graph (no cache, the definition applied to each
step's logits). Sampled laws with them: `test_sampling_distribution`."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specrt.errors import InvalidInputError
from specrt.runtime import GenerationConfig
from specrt.runtime.batching import Request
from specrt.runtime.processors import LogitsProcessors
from tests.conftest import generator_paths, log_softmax_after
from tests.test_greedy import PROMPTS


def by_definition(logits: np.ndarray, context: list[int], prompt_length: int, settings: dict):
    """One position's logits processed as vLLM defines it, token by token: no end token
    (``ends``) before ``min_tokens`` new ones; the bias; the repetition penalty on every token
    of the prompt and the output (a positive logit divided, a negative one multiplied); minus
    frequency x count and presence once present, for the output's tokens."""
    row = np.array(logits, dtype=np.float64)
    if len(context) - prompt_length < settings.get("min_tokens", 0):  # no end yet
        row[list(settings["ends"])] = -np.inf
    for token, value in settings.get("logit_bias", {}).items():
        row[token] += value
    r = settings.get("repetition_penalty", 1.0)
    for token in set(context):
        row[token] = row[token] / r if row[token] > 0 else row[token] * r
    output = context[prompt_length:]
    for token in set(output):
        row[token] -= settings.get("frequency_penalty", 0.0) * output.count(token)
        row[token] -= settings.get("presence_penalty", 0.0)
    return row


SETTINGS = [
    pytest.param(dict(repetition_penalty=1.3), id="repetition"),
    pytest.param(dict(frequency_penalty=0.7, presence_penalty=0.4), id="frequency-presence"),
    pytest.param(dict(logit_bias={7: 3.0, 12: -100.0}), id="bias"),
    pytest.param(
        dict(
            logit_bias={9: 2.0},
            repetition_penalty=0.8,
            frequency_penalty=-0.5,
            presence_penalty=1.5,
        ),
        id="all",
    ),  # fmt: skip
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_each_position_is_processed_as_defined(settings):
    """`LogitsProcessors.apply` over a verification pass: row j as after the row's tokens and
    the proposal's first j, against `by_definition` (to float32 rounding)."""
    rng = np.random.default_rng(3)
    config = GenerationConfig(**settings)
    for trial in range(20):
        vocab, prompt_length = 30, int(rng.integers(1, 6))
        tokens = rng.integers(0, vocab, size=prompt_length + int(rng.integers(0, 8))).tolist()
        proposal = rng.integers(0, vocab, size=int(rng.integers(0, 5))).tolist()
        logits = rng.normal(size=(len(proposal) + 1, vocab)).astype(np.float32) * 3
        given = logits.copy()
        got = config.processors.apply(given, tokens, prompt_length, proposal)
        assert got is given  # in place
        for j in range(len(proposal) + 1):
            want = by_definition(logits[j], tokens + proposal[:j], prompt_length, settings)
            assert np.allclose(got[j], want, rtol=1e-6, atol=1e-5), (trial, j)


def test_no_processors_is_none_and_off_values_are_none():
    assert GenerationConfig().processors is None
    off = GenerationConfig(logit_bias={}, repetition_penalty=1, presence_penalty=0)
    assert off.processors is None
    assert GenerationConfig(presence_penalty=0.1).processors == LogitsProcessors(
        presence_penalty=0.1
    )


def reference_greedy(portable, prompt: list[int], steps: int, settings: dict) -> list[int]:
    """Greedy tokens of the target with the processors, a full pass without cache per step."""
    spec, session, vocab = portable.target.spec, portable.target.session, portable.target.vocab_size
    tokens = list(prompt)
    for _ in range(steps):
        length = len(tokens)
        empty = np.zeros((1, spec.num_kv_heads, 0, spec.head_dim), np.float32)
        feed = {
            spec.io.input_ids: np.array([tokens], dtype=np.int64),
            spec.io.attention_mask: np.ones((1, length), np.int64),
            spec.io.position_ids: np.arange(length)[None],
        }
        feed.update({name: empty for name in spec.io.past_keys + spec.io.past_values})
        logits = session.run([spec.io.logits], feed)[0][0, -1, :vocab]
        tokens.append(int(by_definition(logits, tokens, len(prompt), settings).argmax()))
    return tokens[len(prompt) :]


@pytest.fixture(scope="module")
def generators(llama_bundle):
    return generator_paths(llama_bundle)


@pytest.mark.parametrize("settings", SETTINGS)
def test_greedy_output_is_the_processed_targets(generators, settings):
    """With the processors, greedy output is the target's under them, token for token: the
    target alone and speculative decoding (the draft model, prompt lookup and the hybrid, one
    row and rows sharing calls beside a row without them), as a decode written out here gives
    it; and it differs from the output without them (the test has power)."""
    prompts = PROMPTS[:4]
    encoded = generators["one row"].encode_prompts(prompts)
    expected = [reference_greedy(generators["portable"], ids, 16, settings) for ids in encoded]
    base = GenerationConfig(max_new_tokens=16, ignore_eos=True, **settings)
    plain = generators["one row"].generate(prompts, replace(base, **_off()))
    assert any(p.token_ids != e for p, e in zip(plain, expected))
    for path in ("one row", "batched"):
        generator = generators[path]
        for proposer, k in (("model", 0), ("model", 3), ("lookup", 3), ("hybrid", 4)):
            config = replace(base, proposer=proposer, num_draft_tokens=k)
            got = generator.generate(prompts, config)
            assert [r.token_ids for r in got] == expected, (path, proposer, k)
    # beside rows without them, sharing every call
    requests = [Request(i, ids, base if i % 2 else replace(base, **_off()))
                for i, ids in enumerate(encoded)]  # fmt: skip
    ran = dict(generators["batched"].run(requests))
    assert [ran[i].token_ids for i in (1, 3)] == [expected[1], expected[3]]
    assert [ran[i].token_ids for i in (0, 2)] == [plain[0].token_ids, plain[2].token_ids]


def _off() -> dict:
    return dict(logit_bias={}, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)


def test_bad_processor_settings_are_refused_naming_the_field(generators):
    for field, value, words in [
        ("logit_bias", {"a": 1}, "token ids are integers >= 0"),
        ("logit_bias", {"5": 101}, "logit_bias[5]=101.0 is out of range"),
        ("logit_bias", [1, 2], "use {token id: a number in [-100, 100]}"),
        ("repetition_penalty", 0, "use a number > 0"),
        ("presence_penalty", 2.5, "use a number in [-2, 2]"),
        ("frequency_penalty", "x", "not a number"),
    ]:
        with pytest.raises(InvalidInputError, match=words.replace("[", r"\[")) as caught:
            GenerationConfig(**{field: value})
        assert caught.value.field == field
    assert GenerationConfig(logit_bias={"5": 2, 3: -1}).logit_bias == ((3, -1.0), (5, 2.0))
    generator = generators["one row"]
    vocab = generator.target.vocab_size
    with pytest.raises(InvalidInputError, match=f"logit_bias names token {vocab}, past"):
        generator.generate(["a"], GenerationConfig(logit_bias={vocab: 1}))


def test_seeded_rows_beside_rows_with_processors_sample_as_they_do_alone(generators):
    """Rows sharing calls with rows that have processors keep the graph's softmax at
    temperature 1 (the processed rows warp their own logits): a seeded row's tokens are those
    it draws alone, and so are the processed rows'."""
    prompts = generators["one row"].encode_prompts(PROMPTS[:4])
    plain = GenerationConfig(max_new_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    processed = replace(plain, frequency_penalty=1.0, logit_bias={7: 2.0})
    configs = [plain if i % 2 else processed for i in range(4)]
    requests = [Request(i, ids, c) for i, (ids, c) in enumerate(zip(prompts, configs))]
    ran = dict(generators["batched"].run(requests))
    for i, (ids, config) in enumerate(zip(prompts, configs)):
        [alone] = generators["one row"].generate([ids], replace(config, num_draft_tokens=0))
        assert ran[i].token_ids == alone.token_ids, i


def test_logprobs_of_processed_rows_are_the_models_own(generators):
    """A row with processors lists its tokens' log-probabilities under the model's raw logits
    (vLLM's default), not the processed ones: checked against one plain target pass (reading
    the processed ones fails it)."""
    generator = generators["batched"]
    prompts = generator.encode_prompts(PROMPTS[:3])
    config = GenerationConfig(max_new_tokens=10, ignore_eos=True, logprobs=2,
                              repetition_penalty=1.5, logit_bias={7: 4.0})  # fmt: skip
    reference = generators["one row"].target
    for prompt, result in zip(prompts, generator.generate(prompts, config)):
        new = result.token_ids
        expected = log_softmax_after(reference, prompt + new[:-1], len(new))
        got = [entry.logprob for entry in result.logprobs]
        np.testing.assert_allclose(got, expected[np.arange(len(new)), new], atol=1e-4)


def test_min_tokens_hold_off_the_stop_tokens_and_eos(generators):
    """``min_tokens`` (vLLM's): a stop token cannot come before that many new tokens. An
    output that the target alone ends at its first stop token runs on to the first one after
    ``min_tokens`` (4 more), speculative or not, one row or batched, as a decode written out
    here gives it; EOS, made near certain by a bias, comes right after the 5 held off."""
    generator = generators["one row"]
    [prompt] = generator.encode_prompts(PROMPTS[2:3])
    plain = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    [alone] = generator.generate([prompt], replace(plain, num_draft_tokens=0))
    ids = alone.token_ids  # a stop token first met at new token 4 or later
    at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    stop, least = ids[at], at + 4
    settings = dict(min_tokens=least, ends=[stop])
    expected = reference_greedy(generators["portable"], prompt, 24, settings)
    ends = [i + 1 for i, t in enumerate(expected) if t == stop and i >= least - 1]
    cut, reason = (ends[0], "stop") if ends else (24, "length")
    config = replace(plain, stop_token_ids=[stop], min_tokens=least)
    [early] = generator.generate([prompt], replace(config, min_tokens=0, num_draft_tokens=0))
    assert len(early.token_ids) == at + 1  # without min_tokens it ends at the stop token
    for path in ("one row", "batched"):
        for k in (0, 3):
            [result] = generators[path].generate([prompt], replace(config, num_draft_tokens=k))
            assert result.token_ids == expected[:cut] and result.finish_reason == reason, (path, k)
    [eos] = sorted(generator.eos_token_ids)[:1]
    forced = GenerationConfig(max_new_tokens=24, logit_bias={eos: 30.0}, min_tokens=5)
    for k in (0, 3):
        [result] = generators["batched"].generate([prompt], replace(forced, num_draft_tokens=k))
        assert len(result.token_ids) == 6 and result.token_ids[-1] == eos, k
        assert eos not in result.token_ids[:5]
    with pytest.raises(InvalidInputError, match="min_tokens=25 is out of range") as caught:
        GenerationConfig(max_new_tokens=24, min_tokens=25)
    assert caught.value.field == "min_tokens"

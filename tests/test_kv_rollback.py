"""Rolling the cache back by length gives exactly the logits of a clean history."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.errors import InvalidInputError
from specrt.runtime import SpeculativeGenerator


def fresh_decoder(bundle, engine="auto"):
    return SpeculativeGenerator.from_bundle(bundle, threads=1, engine=engine).target


@pytest.mark.parametrize("engine", ["portable", "onnxruntime"])
def test_logits_after_rollback_equal_clean_history(llama_bundle, engine):
    rng = np.random.default_rng(0)
    decoder = fresh_decoder(llama_bundle, engine)
    vocab = decoder.vocab_size
    prompt = rng.integers(3, vocab, 9).tolist()
    rejected = rng.integers(3, vocab, 5).tolist()
    accepted, continuation = rejected[:2], rng.integers(3, vocab, 3).tolist()

    decoder.forward(prompt)
    decoder.forward(rejected)  # verify 5 tokens, keep 2 of them
    decoder.rollback(len(prompt) + len(accepted))
    assert decoder.length == len(prompt) + 2
    after_rollback = decoder.forward(continuation).logits.copy()
    decoder.rollback(0)  # and the generator's next row starts clean from the same buffers
    decoder.forward(prompt[:4])
    restart = decoder.forward(prompt[4:]).logits.copy()

    # The reference is the other graph: rollback is checked against an independent route.
    other = "portable" if engine == "onnxruntime" else "onnxruntime"
    clean = fresh_decoder(llama_bundle, other).forward(prompt + accepted + continuation)
    clean_logits = clean.logits
    np.testing.assert_allclose(after_rollback, clean_logits[-3:], atol=1e-5, rtol=0)
    np.testing.assert_allclose(restart, clean_logits[4 : len(prompt)], atol=1e-5, rtol=0)
    # and the rolled-back tokens really mattered: a history that kept them gives other logits
    polluted = fresh_decoder(llama_bundle).forward(prompt + rejected + continuation).logits[-3:]
    assert np.abs(polluted - clean_logits[-3:]).max() > 1e-2


def test_in_place_cache_is_never_copied(llama_bundle):
    """The engine's cache is one buffer per layer, written by onnxruntime in place: steps and
    rollbacks keep the same memory (no per-step allocation, no whole-cache copy)."""
    decoder = fresh_decoder(llama_bundle, "onnxruntime")
    buffers = list(decoder._buffers)
    decoder.forward([3, 4, 5, 6])
    first = buffers[0].copy()
    decoder.rollback(2)
    decoder.forward([7, 8])
    assert all(a is b for a, b in zip(decoder._buffers, buffers))
    changed = np.flatnonzero(np.abs(buffers[0] - first).sum(axis=(0, 2)))  # [rows, pos, kv]
    assert changed.tolist() == [2, 3]  # the rolled-back positions were overwritten in place


def test_rollback_never_grows_the_cache(llama_generator):
    decoder = llama_generator.target
    decoder.reset()
    decoder.forward([3, 4, 5])
    decoder.rollback(10)
    assert decoder.length == 3


def test_feeding_past_max_positions_is_refused(llama_generator):
    decoder = llama_generator.target
    decoder.reset()
    decoder.forward(list(range(3, 40)) * 3)  # 111 of 128 positions
    with pytest.raises(InvalidInputError, match="exceed the 128 this decoder holds"):
        decoder.forward([5] * 20)
    assert decoder.length == 111  # the cache is untouched


@pytest.mark.parametrize("engine", ["portable", "onnxruntime"])
def test_probabilities_are_the_softmax_of_the_logits(llama_bundle, engine):
    """The engine graph computes the softmax with the logits (read by the draft's confidence and
    temperature-1 sampling); the portable graph does not."""
    decoder = fresh_decoder(llama_bundle, engine)
    for tokens in ([3, 4, 5, 6, 7], [8], [9, 10]):
        out = decoder.forward(tokens)
        logits = out.logits
        if engine == "portable":
            assert out.probabilities is None
            continue
        assert out.probabilities.shape == logits.shape
        expected = np.exp(logits - logits.max(axis=-1, keepdims=True))
        expected /= expected.sum(axis=-1, keepdims=True)
        np.testing.assert_allclose(out.probabilities, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("engine", ["portable", "onnxruntime"])
def test_prefill_in_chunks_equals_one_call(llama_bundle, engine, monkeypatch):
    """A prompt is fed in chunks (bounded logits arrays); the cache it leaves is the one a single
    call leaves."""
    from specrt.backends import base

    prompt = np.random.default_rng(1).integers(3, 40, 23).tolist()
    whole = fresh_decoder(llama_bundle, engine)
    whole.forward(prompt)
    expected = whole.forward([5, 6]).logits.copy()
    monkeypatch.setattr(base, "PREFILL_CHUNK", 5)
    chunked = fresh_decoder(llama_bundle, engine)
    chunked.prefill(prompt)
    assert chunked.length == len(prompt)
    np.testing.assert_allclose(chunked.forward([5, 6]).logits, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("engine", ["portable", "onnxruntime"])
def test_cache_memory_is_reported_for_every_engine(llama_bundle, engine):
    """What `specrt batch` and `specrt serve` print: the portable graph's cache grows with its
    row (it reported 0 bytes), the engine's is held for the whole length."""
    decoder = fresh_decoder(llama_bundle, engine)
    spec = decoder.spec
    per_position = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4  # float32
    assert decoder.cache_bytes_per_row == per_position * decoder.max_positions
    decoder.forward([3, 4, 5, 6, 7])
    held = decoder.cache_bytes
    if engine == "portable":
        assert held == per_position * 5
        decoder.forward([8, 9])
        assert decoder.cache_bytes == per_position * 7
    else:
        assert 0 < held <= decoder.cache_bytes_per_row

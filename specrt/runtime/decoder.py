"""One exported decoder (target or draft) and its KV cache.

The cache keeps what the model has seen as arrays plus a length. Rolling back rejected tokens is
setting the length: nothing is copied until the next call feeds the kept prefix.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import onnxruntime as ort

from specrt.bundle import ModelSpec
from specrt.errors import BundleError, InvalidInputError

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
# Positions per call when feeding a prompt. A portable graph returns logits for every position
# fed, [count, vocab] floats: 2.5 GB for 4k positions of a 152k vocabulary in one call, 160 MB
# in chunks of this; an engine returns the last position's only, and chunks bound its
# activations.
PREFILL_CHUNK = 256


class Decoder(Protocol):
    """What the generator needs of a model: logits for new tokens after a cached prefix."""

    role: str
    vocab_size: int
    max_positions: int
    run_time_s: float  # total time inside onnxruntime
    last_run_s: float
    # softmax of the last call's logits [tokens, vocab] where the graph computes it, else None
    probabilities: np.ndarray | None

    @property
    def length(self) -> int: ...

    def reset(self) -> None: ...

    def rollback(self, length: int) -> None: ...

    def forward(self, tokens: Sequence[int], keep: int = 0) -> np.ndarray: ...

    def prefill(self, tokens: Sequence[int]) -> None: ...


class KVCache:
    """Per-layer key/value arrays ``[1, kv_heads, T, head_dim]`` and the valid length ``T'<=T``."""

    def __init__(self, spec: ModelSpec) -> None:
        self._spec = spec
        self.reset()

    def reset(self) -> None:
        empty = np.zeros(
            (1, self._spec.num_kv_heads, 0, self._spec.head_dim), NUMPY_DTYPES[self._spec.dtype]
        )
        self.keys = [empty] * self._spec.num_layers
        self.values = [empty] * self._spec.num_layers
        self.length = 0

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` positions."""
        self.length = min(self.length, length)

    def past(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        if arrays[0].shape[2] == self.length:
            return arrays
        return [np.ascontiguousarray(a[:, :, : self.length]) for a in arrays]

    def store(self, keys: list[np.ndarray], values: list[np.ndarray]) -> None:
        self.keys, self.values = keys, values
        self.length = keys[0].shape[2]


class DecoderBase:
    """What both decoders share: the session, the limits and the time spent in onnxruntime."""

    def __init__(
        self,
        session: ort.InferenceSession,
        spec: ModelSpec,
        vocab_size: int,
        role: str,
        max_length: int | None = None,
    ) -> None:
        """``max_length`` caps the sequence length below the model's max positions (an in-place
        cache preallocates that many)."""
        check_session_io(session, spec, role)
        self.session = session
        self.spec = spec
        self.role = role
        self.vocab_size = vocab_size
        self.max_positions = min(spec.max_positions, max_length or spec.max_positions)
        self.run_time_s = 0.0  # time spent inside onnxruntime, for overhead accounting
        self.last_run_s = 0.0
        self.probabilities: np.ndarray | None = None

    def prefill(self, tokens: Sequence[int]) -> None:
        """Feed tokens whose logits nobody reads (a prompt), ``PREFILL_CHUNK`` at a time, asking
        for the last position's logits only (an engine then skips the head for the rest)."""
        self._check_room(self.length, len(tokens))
        for start in range(0, len(tokens), PREFILL_CHUNK):
            self.forward(tokens[start : start + PREFILL_CHUNK], keep=1)

    def _check_room(self, start: int, count: int) -> None:
        if start + count > self.max_positions:
            raise InvalidInputError(
                f"{self.role}: {start + count} positions exceed the {self.max_positions} this "
                "decoder holds (the model's max positions, or the max_length given at load)"
            )

    def _timed(self, run, *args):
        started = time.perf_counter()
        result = run(*args)
        self.last_run_s = time.perf_counter() - started
        self.run_time_s += self.last_run_s
        return result


class OnnxDecoder(DecoderBase):
    """Runs an exported decoder on new tokens on top of its cache; returns their logits."""

    def __init__(
        self,
        session: ort.InferenceSession,
        spec: ModelSpec,
        vocab_size: int,
        role: str,
        max_length: int | None = None,
    ) -> None:
        super().__init__(session, spec, vocab_size, role, max_length)
        self.cache = KVCache(spec)
        io = spec.io
        self._outputs = [io.logits, *io.present_keys, *io.present_values]
        self._positions = np.arange(self.max_positions, dtype=np.int64)[None]
        # Sliced per call instead of allocated: row views of this are contiguous.
        self._ones = np.ones((1, self.max_positions), dtype=np.int64)

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.reset()

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def forward(self, tokens: Sequence[int], keep: int = 0) -> np.ndarray:
        """Feed ``tokens`` after the cached prefix; return logits ``[len(tokens), vocab]``, or
        of the last ``keep`` positions (the portable graph computes them all anyway)."""
        io, cache = self.spec.io, self.cache
        start, count = cache.length, len(tokens)
        self._check_room(start, count)
        feed = {io.input_ids: np.asarray([tokens], dtype=np.int64)}
        if io.attention_mask:
            feed[io.attention_mask] = self._ones[:, : start + count]
        if io.position_ids:
            feed[io.position_ids] = self._positions[:, start : start + count]
        feed.update(zip(io.past_keys, cache.past(cache.keys)))
        feed.update(zip(io.past_values, cache.past(cache.values)))
        logits, *presents = self._timed(self.session.run, self._outputs, feed)
        layers = self.spec.num_layers
        cache.store(presents[:layers], presents[layers:])
        return logits[0, count - (keep or count) :, : self.vocab_size]


def check_session_io(session: ort.InferenceSession, spec: ModelSpec, role: str) -> None:
    """Refuse a graph whose inputs/outputs are not the ones the manifest names."""
    io = spec.io
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name for o in session.get_outputs()}
    wanted = [io.input_ids, *io.past_keys, *io.past_values]
    optional = (
        io.attention_mask,
        io.position_ids,
        io.seqlens_k,
        io.total_length,
        io.logits_to_keep,
    )
    wanted += [n for n in optional if n]
    produced = [io.logits, *io.present_keys, *io.present_values]
    produced += [io.probabilities] if io.probabilities else []
    missing = [n for n in wanted if n not in inputs] + [n for n in produced if n not in outputs]
    if missing:
        raise BundleError(
            f"{role}: the ONNX graph lacks {missing[:4]} named in the manifest; "
            "the graph and manifest come from different exports, re-export the bundle"
        )
    shape = inputs[io.past_keys[0]].shape
    for axis, expected in ((1, spec.num_kv_heads), (3, spec.head_dim)):
        if isinstance(shape[axis], int) and shape[axis] != expected:
            raise BundleError(
                f"{role}: cache input {io.past_keys[0]} has shape {shape}, the manifest "
                f"says kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}; "
                "re-export the bundle"
            )


def make_decoder(
    session: ort.InferenceSession,
    spec: ModelSpec,
    vocab_size: int,
    role: str,
    max_length: int | None = None,
) -> Decoder:
    """The decoder class the graph's cache contract needs (``spec.cache``). ``max_length`` caps
    the sequence length below the model's max positions (an in-place cache preallocates it)."""
    if spec.cache == "in_place":
        from specrt.runtime.inplace_decoder import InPlaceDecoder

        return InPlaceDecoder(session, spec, vocab_size, role, max_length)
    return OnnxDecoder(session, spec, vocab_size, role, max_length)

"""What a backend must provide: a `Decoder` runs one model on new tokens after its cached prefix.

A backend holds one model's graph, its session and its KV cache. The runtime only ever calls the
methods below, so the onnxruntime engine (`in_place.py`), the portable graph (`portable.py`) and
later GPU backends are interchangeable behind them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import onnxruntime as ort

from specrt.bundle import ModelIO, ModelSpec
from specrt.errors import BundleError, InvalidInputError

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}
# Positions per call when feeding a prompt. A portable graph returns logits for every position
# fed, [count, vocab] floats: 2.5 GB for 4k positions of a 152k vocabulary in one call, 160 MB
# in chunks of this; an engine returns the last position's only, and chunks bound its
# activations.
PREFILL_CHUNK = 256
# A quantised target graph's input (`ort_builder._even_rows`): 1, a call of an odd count computes
# a copy of its last position too; 0, it does not, where the running CPU gives a row alone the
# bits of a row among others (`loading.check_exact_rows` measures which).
PAIR_ROWS = "pair_rows"


def whole_chunks(prompt: Sequence[int], cached: int = 0) -> Sequence[int]:
    """The part of ``prompt`` prefilled ahead of its first pass, after the ``cached`` positions
    the cache holds already: whole chunks, leaving at least its last token to the pass whose
    last position gives the first new token."""
    return prompt[cached : cached + (len(prompt) - 1 - cached) // PREFILL_CHUNK * PREFILL_CHUNK]


# What a call must bring back to the host. A device backend copies only that; a host backend
# returns everything it has whatever is asked.
NEED_LOGITS = "logits"  # the logits rows (to warp them, or to check them)
NEED_PROBABILITIES = "probabilities"  # the graph's softmax rows (temperature 1, confidence)
NEED_ARGMAX = "argmax"  # each row's best token, its logit and probability (greedy decoding)


@dataclass
class Forward:
    """What one call returns for the last positions fed, as far as the backend has it and the
    caller asked for it: ``logits [rows, vocab]``, their softmax ``probabilities``, and
    ``argmax`` (each row's best token) with ``max_logit`` (its logit, so NaN/inf can be
    refused without the logits) and ``max_probability`` (its probability).

    The arrays belong to the decoder and are valid until its next call: a backend may write
    the next call's output into the same memory. Copy what must outlive the next call."""

    logits: np.ndarray | None
    probabilities: np.ndarray | None = None
    argmax: list[int] | None = None
    max_logit: np.ndarray | None = None
    max_probability: np.ndarray | None = None
    hidden: np.ndarray | None = None  # an EAGLE head's hidden states [rows, kept, hidden]


class Decoder(Protocol):
    """One model (target or draft) and its KV cache, as the runtime uses it."""

    role: str  # "target" or "draft": named in error messages
    vocab_size: int  # logits are cut to this width
    max_positions: int  # positions the cache holds
    model_max_positions: int  # the model's own limit (max_positions may be lower: max_length)
    run_time_s: float  # total time spent running the model, for overhead accounting

    @property
    def length(self) -> int:
        """Positions in the cache (tokens seen and not rolled back)."""
        ...

    def reset(self) -> None:
        """Forget every position (a new sequence starts)."""
        ...

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` positions; never grows the cache."""
        ...

    def forward(
        self, tokens: Sequence[int], keep_last: int = 0, need: str = NEED_LOGITS
    ) -> Forward:
        """Feed ``tokens`` after the cached prefix; return what ``need`` names (at least) for
        all of them, or for the last ``keep_last`` only."""
        ...

    def prefill(self, tokens: Sequence[int]) -> None:
        """Feed tokens whose logits nobody reads (a prompt)."""
        ...


class DecoderBase:
    """What the onnxruntime decoders share: the session check, the limits, prefill in chunks and
    the time spent in onnxruntime. Subclasses provide ``length``, ``forward``, ``reset`` and
    ``rollback``."""

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
        self.model_max_positions = spec.max_positions
        self.max_positions = min(spec.max_positions, max_length or spec.max_positions)
        self.run_time_s = 0.0

    @property
    def cache_bytes_per_row(self) -> int:
        """Cache memory one row takes at ``max_positions`` (keys and values, every layer)."""
        spec = self.spec
        per_position = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim
        return per_position * self.max_positions * np.dtype(NUMPY_DTYPES[spec.dtype]).itemsize

    @property
    def cache_bytes(self) -> int:
        """Cache memory held now: a one-row cache is preallocated whole (a portable graph's
        grows with its row and says so)."""
        return self.cache_bytes_per_row

    def prefill(self, tokens: Sequence[int]) -> None:
        """Feed a prompt ``PREFILL_CHUNK`` positions at a time, asking for the last position's
        logits only (an engine then skips the head for the rest)."""
        self._check_room(self.length, len(tokens))
        for start in range(0, len(tokens), PREFILL_CHUNK):  # ARGMAX: the least to bring back
            self.forward(tokens[start : start + PREFILL_CHUNK], keep_last=1, need=NEED_ARGMAX)

    def _check_room(self, start: int, count: int) -> None:
        if start + count > self.max_positions:
            raise InvalidInputError(
                f"{self.role}: {start + count} positions exceed the {self.max_positions} this "
                "decoder holds (the model's max positions, or the max_length given at load)"
            )

    def _timed(self, run, *args):
        started = time.perf_counter()
        result = run(*args)
        self.run_time_s += time.perf_counter() - started
        return result


def kept_rows_input(io: ModelIO) -> tuple[str | None, int]:
    """The input that says how many trailing positions get logits, and the sign its value
    takes: ``logits_start`` holds -n (engines now), ``logits_to_keep`` n (engines of earlier
    releases); None where the graph keeps every position."""
    if io.logits_start:
        return io.logits_start, -1
    return io.logits_to_keep, 1


def shared_ortvalue(array: np.ndarray) -> ort.OrtValue:
    """An OrtValue over the array's own memory: writes to either are seen by both."""
    return ort.OrtValue.ortvalue_from_numpy(array)


class OutputMemory:
    """Host memory that the outputs of every call shape share: one buffer per output, as large
    as the largest call so far. A call's arrays are views of its front, valid until the next
    call (`Forward`). Memory written for the first time costs page faults (on some virtual
    machines as much as the call itself), and arrays of their own for each shape (rows x
    positions kept x vocabulary) would each be that much memory again."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}
        self.grown = 0  # times a buffer was replaced by a larger one

    def array(self, name: str, shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
        """An array of ``shape`` over the front of output ``name``'s buffer."""
        size = int(np.prod(shape))
        buffer = self._buffers.get(name)
        if buffer is None or buffer.size < size:
            # twice the old size at least: a few larger buffers over a job, not one per shape
            grown = size if buffer is None else max(size, 2 * buffer.size)
            buffer = self._buffers[name] = np.empty(grown, dtype=dtype)
            self.grown += 1
        return buffer[:size].reshape(shape)


def check_session_io(session: ort.InferenceSession, spec: ModelSpec, role: str) -> None:
    """Refuse a graph whose inputs/outputs are not the ones the manifest names."""
    io = spec.io
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    wanted = [io.input_ids, *io.past_keys, *io.past_values]
    optional = (
        io.attention_mask,
        io.position_ids,
        io.seqlens_k,
        io.total_length,
        io.logits_to_keep,
        io.logits_start,
        io.cache_indices,
        io.local_attention_mask,
    )
    wanted += [n for n in optional if n]
    produced = [io.logits, *io.present_keys, *io.present_values]
    optional = (io.probabilities, io.argmax, io.max_logit, io.max_probability)
    produced += [n for n in optional if n]
    missing = [n for n in wanted if n not in inputs] + [n for n in produced if n not in outputs]
    if missing:
        raise BundleError(
            f"{role}: the ONNX graph lacks {missing[:4]} named in the manifest; "
            "the graph and manifest come from different exports, re-export the bundle"
        )
    width = outputs[io.logits].shape[-1]
    if isinstance(width, int) and width != spec.vocab_size:
        raise BundleError(
            f"{role}: the graph's logits are {width} wide, the manifest says vocab_size="
            f"{spec.vocab_size}; the graph and manifest come from different exports, re-export "
            "the bundle"
        )
    shape = inputs[io.past_keys[0]].shape
    expected_sizes = ((1, spec.num_kv_heads), (3, spec.head_dim))
    if spec.cache == "batched":  # [rows, positions, kv_heads * head_dim]
        expected_sizes = ((2, spec.num_kv_heads * spec.head_dim),)
    for axis, expected in expected_sizes:
        if isinstance(shape[axis], int) and shape[axis] != expected:
            raise BundleError(
                f"{role}: cache input {io.past_keys[0]} has shape {shape}, the manifest "
                f"says kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}; "
                "re-export the bundle"
            )


def one_call_against_one_each(decoder: Decoder, tokens: Sequence[int]) -> tuple[np.ndarray, float]:
    """Feed ``tokens`` after ``decoder``'s cached prefix in one call (as a verification does),
    then again one call each (as decoding alone does): the one call's logits and the largest
    difference between the two, 0 where verifying computes what decoding alone does. The
    cache ends holding the prefix and ``tokens``."""
    prefix = decoder.length
    together = decoder.forward(tokens).logits.copy()  # valid until the next call
    decoder.rollback(prefix)
    alone = np.concatenate([decoder.forward([token]).logits.copy() for token in tokens])
    return together, float(np.abs(together - alone).max())

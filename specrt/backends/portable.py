"""The portable graph (standard ONNX ops, what TensorRT takes) on onnxruntime.

Its cache is fed back each call: ``present = past + new``. The cache keeps those arrays plus a
length; rolling back rejected tokens is setting the length, and nothing is copied until the next
call feeds the kept prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from specrt.backends.base import NEED_LOGITS, NUMPY_DTYPES, DecoderBase, Forward
from specrt.backends.rows import CAPACITY_STEP, RowsDecoder
from specrt.bundle import ModelSpec
from specrt.errors import BundleError


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


class PortableDecoder(DecoderBase):
    """Runs a portable graph on new tokens on top of its cache; returns their logits."""

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

    @property
    def cache_bytes(self) -> int:
        """What the cache holds now: past + new comes back each call, so it grows with the row."""
        return sum(array.nbytes for array in (*self.cache.keys, *self.cache.values))

    def reset(self) -> None:
        self.cache.reset()

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def forward(
        self, tokens: Sequence[int], keep_last: int = 0, need: str = NEED_LOGITS
    ) -> Forward:
        """Logits of the last ``keep_last`` positions fed (all by default); the graph computes
        them all anyway, and no probabilities."""
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
        return Forward(logits[0, count - (keep_last or count) :, : self.vocab_size])


class PortableRowsDecoder(RowsDecoder):
    """The portable graph for many rows at once: each call feeds ``[rows, S]`` tokens after
    each row's own prefix. The rows' caches live in buffers of ours ``[rows, kv_heads,
    positions, head_dim]``; a call feeds P positions (P: the longest row) as ``past``, each
    shorter row's prefix right-aligned with the padding before it masked through
    ``attention_mask``, gives every token its row's own ``position_ids``, and copies the S new
    positions of ``present`` back to where each row's prefix ends. The copies make it slower
    than the engine; it is what runs batches for models without one. A bundle with an EAGLE
    head runs its portable graphs here, one row or many: the target's features of every
    position are kept (`RowsDecoder.features`), and the head's graph takes ``hidden``, so
    `EagleDraft` drafts over these as over the engines."""

    POSITION_AXIS = 2

    def __init__(
        self,
        session: ort.InferenceSession,
        spec: ModelSpec,
        vocab_size: int,
        role: str,
        max_length: int | None = None,
        max_batch: int = 1,
    ) -> None:
        super().__init__(session, spec, vocab_size, role, max_length, max_batch)
        io = spec.io
        if not io.attention_mask:
            raise BundleError(
                f"{role}: the portable graph takes no attention_mask, so its rows cannot be "
                "batched; load it with max_batch=1 (or re-export the bundle)"
            )
        self._outputs = [io.logits, *io.present_keys, *io.present_values]
        # a target with an EAGLE head's features; a head's hidden states
        self._outputs += [io.features] * bool(self._feature_width)
        self._outputs += [io.hidden_out] * bool(self._hidden_width)
        self._grow(min(self.max_positions, CAPACITY_STEP))

    def _buffer_shape(self, capacity: int) -> tuple[int, ...]:
        return (self.max_batch, self.spec.num_kv_heads, capacity, self.spec.head_dim)

    def _call(
        self,
        start: int,
        n: int,
        tokens: np.ndarray,
        keep_last: int,
        fed: int | np.ndarray,
        need: str = NEED_LOGITS,
        hidden: np.ndarray | None = None,
    ) -> Forward:
        """``hidden [n, S, width]`` (or one row's ``[width]``): an EAGLE head's input features."""
        io = self.spec.io
        for slot in range(start, start + n):  # the call writes these slots
            self.kept_positions.pop(slot, None)
        lengths = self.lengths[start : start + n]
        longest, count = int(lengths.max()), tokens.shape[1]
        self._check_room(longest, count)
        if longest + count > self.capacity:
            self._grow(longest + count)
        # Each row's prefix is fed right-aligned (padding before it), so that distances between
        # cache slots are distances between positions, as a sliding window measures them.
        slots = np.arange(longest + count)
        seen = slots >= longest - lengths[:, None]
        positions = lengths[:, None] + np.arange(count)
        feed = {
            io.input_ids: np.ascontiguousarray(tokens, dtype=np.int64),
            io.attention_mask: seen.astype(np.int64),
        }
        if io.position_ids:  # else the graph counts positions along the mask
            feed[io.position_ids] = positions
        if self._hidden_width:
            shape = (n, count, self._hidden_width)
            feed[io.hidden_states] = np.ascontiguousarray(np.broadcast_to(hidden, shape), "f4")
        past = [self._right_aligned(b[start : start + n], lengths, longest) for b in self._buffers]
        feed.update(zip([name for name, _ in self._names], past))
        logits, *outputs = self._timed(self.session.run, self._outputs, feed)
        presents = outputs[: len(self._buffers)]
        rows = np.arange(n)[:, None]
        for buffer, present in zip(self._buffers, presents):  # [n, kv_heads, P + S, head_dim]
            new = present[:, :, longest:].transpose(0, 2, 1, 3)  # [n, S, kv_heads, head_dim]
            buffer[start : start + n].transpose(0, 2, 1, 3)[rows, positions] = new
        if self._feature_width:
            self._keep_features(start, n, fed, outputs[len(self._buffers)])
        self.lengths[start : start + n] += fed
        kept = slice(count - keep_last, None)
        states = outputs[-1][:, kept] if self._hidden_width else None
        return Forward(logits[:, kept, : self.vocab_size], hidden=states)

    @staticmethod
    def _right_aligned(buffer: np.ndarray, lengths: np.ndarray, longest: int) -> np.ndarray:
        """``[n, kv_heads, longest, head_dim]``: each row's first ``lengths[row]`` positions
        at the end, zeros before them."""
        if (lengths == longest).all():
            return np.ascontiguousarray(buffer[:, :, :longest])
        past = np.zeros(buffer.shape[:2] + (longest,) + buffer.shape[3:], buffer.dtype)
        for row, length in enumerate(lengths.tolist()):
            past[row, :, longest - length :] = buffer[row, :, :length]
        return past

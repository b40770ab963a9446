"""A decoder whose KV cache is updated in place: one preallocated buffer per layer and kind.

For engine graphs with ``cache == "in_place"`` (GroupQueryAttention): the graph reads the buffer
as ``past`` and writes the new positions into the same memory as ``present`` (onnxruntime IO
binding binds both names to one OrtValue). The valid length is the attention mask's width, so a
step allocates and copies no cache, and rolling back rejected tokens only lowers ``length``: the
next call overwrites the stale positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from specrt.bundle import ModelSpec
from specrt.errors import InvalidInputError
from specrt.runtime.decoder import NUMPY_DTYPES, DecoderBase

_KEEP_WIDTHS = 80


class InPlaceDecoder(DecoderBase):
    """Runs an in-place-cache graph on new tokens after its cached prefix; returns their logits."""

    def __init__(
        self,
        session: ort.InferenceSession,
        spec: ModelSpec,
        vocab_size: int,
        role: str,
        max_length: int | None = None,
    ) -> None:
        """``max_length`` caps the preallocated cache (and so the sequence length) below the
        model's max positions: a 128k-position model would otherwise reserve its whole cache."""
        super().__init__(session, spec, vocab_size, role, max_length)
        if not spec.io.attention_mask:
            raise InvalidInputError(f"{role}: an in-place cache graph needs an attention_mask")
        self.length = 0
        io = spec.io
        shape = (1, spec.num_kv_heads, self.max_positions, spec.head_dim)
        self._buffers = [
            np.zeros(shape, NUMPY_DTYPES[spec.dtype]) for _ in range(2 * spec.num_layers)
        ]
        self._binding = session.io_binding()
        names = zip(
            [*io.past_keys, *io.past_values], [*io.present_keys, *io.present_values], strict=True
        )
        for (past, present), buffer in zip(names, self._buffers, strict=True):
            value = ort.OrtValue.ortvalue_from_numpy(buffer)  # shares the numpy memory
            self._binding.bind_ortvalue_input(past, value)
            self._binding.bind_ortvalue_output(present, value)
        # Logits land in our own arrays, one per call width: no output is allocated or wrapped
        # per call. Widths up to _KEEP_WIDTHS (drafting, verification) are kept for reuse.
        self._logits: dict[int, tuple[np.ndarray, ort.OrtValue]] = {}

    def reset(self) -> None:
        self.length = 0

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` positions (the rest is overwritten by later calls)."""
        self.length = min(self.length, length)

    def forward(self, tokens: Sequence[int]) -> np.ndarray:
        """Feed ``tokens`` after the cached prefix; return logits ``[len(tokens), vocab]``.

        The array is reused by the next call with as many tokens: copy what must outlive it."""
        start, count = self.length, len(tokens)
        self._check_room(start, count)
        io, binding = self.spec.io, self._binding
        binding.bind_cpu_input(io.input_ids, np.asarray([tokens], dtype=np.int64))
        binding.bind_cpu_input(io.attention_mask, self._ones[:, : start + count])
        logits, value = self._logits.get(count) or self._logits_buffer(count)
        binding.bind_ortvalue_output(io.logits, value)
        self._timed(self.session.run_with_iobinding, binding)
        self.length = start + count
        return logits[0, :, : self.vocab_size]

    def _logits_buffer(self, count: int) -> tuple[np.ndarray, ort.OrtValue]:
        logits = np.empty((1, count, self.spec.vocab_size), dtype=np.float32)
        pair = (logits, ort.OrtValue.ortvalue_from_numpy(logits))
        if count <= _KEEP_WIDTHS:
            self._logits[count] = pair
        return pair

"""A decoder whose KV cache is updated in place: one preallocated buffer per layer and kind.

For engine graphs with ``cache == "in_place"`` (GroupQueryAttention): the graph reads the buffer
as ``past`` and writes the new positions into the same memory as ``present`` (onnxruntime IO
binding binds both names to one OrtValue). The valid length is fed as two numbers, so a step
allocates and copies no cache, and rolling back rejected tokens only lowers ``length``: the next
call overwrites the stale positions.

Every input and output is bound once to memory of ours and a call only writes new values into
it (token ids, lengths); a call with a new number of tokens rebinds the ids and logits arrays
kept for that width. A draft step is then one onnxruntime call and a few stores, which matters
when the draft model's whole step takes ~50 us.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from specrt.bundle import ModelSpec
from specrt.errors import BundleError
from specrt.runtime.decoder import NUMPY_DTYPES, DecoderBase

_KEEP_WIDTHS = 80  # calls of up to this many tokens (drafting, verification) keep their arrays


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
        io = spec.io
        if not (io.seqlens_k and io.total_length and io.logits_to_keep):
            raise BundleError(
                f"{role}: this in-place cache engine has the inputs of engines built by earlier "
                "versions of specrt (an attention mask, or no logits_to_keep); rebuild the "
                "bundle's engines with `specrt build --bundle DIR` (or run it with engine "
                "'portable')"
            )
        super().__init__(session, spec, vocab_size, role, max_length)
        self.length = 0
        binding = self._binding = session.io_binding()
        shape = (1, spec.num_kv_heads, self.max_positions, spec.head_dim)
        names = zip(
            [*io.past_keys, *io.past_values], [*io.present_keys, *io.present_values], strict=True
        )
        self._buffers = []
        for past, present in names:
            buffer = np.zeros(shape, NUMPY_DTYPES[spec.dtype])
            value = _shared(buffer)
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
            self._buffers.append(buffer)
        self._seqlens_k = np.zeros(1, dtype=np.int32)
        self._total_length = np.zeros((), dtype=np.int32)
        binding.bind_ortvalue_input(io.seqlens_k, _shared(self._seqlens_k))
        binding.bind_ortvalue_input(io.total_length, _shared(self._total_length))
        self._logits_to_keep = np.ones(1, dtype=np.int64)
        binding.bind_ortvalue_input(io.logits_to_keep, _shared(self._logits_to_keep))
        # The graph's softmax is the distribution only if it spans exactly the vocabulary.
        self._with_probabilities = bool(io.probabilities) and spec.vocab_size == vocab_size
        self._widths: dict[tuple[int, int], _Width] = {}
        self._width: _Width | None = None

    def reset(self) -> None:
        self.length = 0

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` positions (the rest is overwritten by later calls)."""
        self.length = min(self.length, length)

    def forward(self, tokens: Sequence[int], keep: int = 0) -> np.ndarray:
        """Feed ``tokens`` after the cached prefix; return logits ``[len(tokens), vocab]``, or
        of the last ``keep`` positions only (and set ``probabilities`` where the graph computes
        them).

        The arrays are reused by the next call of the same shape: copy what must outlive it."""
        count = len(tokens)
        total = self.length + count
        self._check_room(self.length, count)
        width = self._width
        key = (count, keep or count)
        if width is None or width.key != key:
            width = self._bind_width(*key)
        width.ids[0] = tokens
        self._seqlens_k[0] = total - 1
        self._total_length.fill(total)
        self._timed(self.session.run_with_iobinding, self._binding)
        self.length = total
        return width.logits

    def _bind_width(self, count: int, keep: int) -> _Width:
        width = self._widths.get((count, keep))
        if width is None:
            width = _Width(
                count, keep, self.spec.vocab_size, self.vocab_size, self._with_probabilities
            )
            if count <= _KEEP_WIDTHS:
                self._widths[width.key] = width
        io, binding = self.spec.io, self._binding
        self._logits_to_keep[0] = keep
        binding.bind_ortvalue_input(io.input_ids, width.values[0])
        binding.bind_ortvalue_output(io.logits, width.values[1])
        if self._with_probabilities:
            binding.bind_ortvalue_output(io.probabilities, width.values[2])
        self._width = width
        self.probabilities = width.probabilities
        return width


class _Width:
    """The arrays one call shape binds: ``count`` token ids ``[1, count]``, logits and
    probabilities of the last ``keep`` positions ``[1, keep, graph vocab]``, with the row views
    the decoder hands out."""

    def __init__(
        self, count: int, keep: int, graph_vocab: int, vocab: int, probabilities: bool
    ) -> None:
        self.key = (count, keep)
        self.ids = np.zeros((1, count), dtype=np.int64)
        logits = np.empty((1, keep, graph_vocab), dtype=np.float32)
        self.logits = logits[0, :, :vocab]
        arrays = [self.ids, logits]
        self.probabilities = None
        if probabilities:
            arrays.append(np.empty((1, keep, graph_vocab), dtype=np.float32))
            self.probabilities = arrays[-1][0]
        self.values = [_shared(a) for a in arrays]


def _shared(array: np.ndarray) -> ort.OrtValue:
    """An OrtValue over the array's own memory: writes to either are seen by both."""
    return ort.OrtValue.ortvalue_from_numpy(array)

"""The onnxruntime engine's decoder: its KV cache is one preallocated buffer per layer and kind,
updated in place.

For engine graphs with ``cache == "in_place"`` (GroupQueryAttention): the graph reads the buffer
as ``past`` and writes the new positions into the same memory as ``present`` (onnxruntime IO
binding binds both names to one OrtValue). The valid length is fed as two numbers, so a step
allocates and copies no cache, and rolling back rejected tokens only lowers ``length``: the next
call overwrites the stale positions.

On the CPU every input and output is bound once to memory of ours and a call only writes new
values into it (token ids, lengths); a call of another shape (tokens fed, logits kept) rebinds
the arrays kept for that shape. A draft step is then one onnxruntime call and a few stores,
which matters when the draft model's whole step is a few dozen microseconds. A device engine
pushes its host inputs before each run instead (`HostInputs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from specrt.backends.base import (
    NEED_LOGITS,
    NUMPY_DTYPES,
    DecoderBase,
    Forward,
    OutputMemory,
    kept_rows_input,
    shared_ortvalue,
)
from specrt.backends.host_inputs import HostInputs
from specrt.bundle import ModelSpec
from specrt.errors import BundleError

# Calls of up to this many tokens (drafting, verification) keep their arrays for the next call
# of the same shape; longer ones (prompt chunks) allocate theirs each time.
MAX_KEPT_CALL_TOKENS = 80


class InPlaceBase(DecoderBase):
    """What the in-place decoders share: one cache buffer per layer and kind, zeroed once, bound
    as past and present, and the valid length as the cache's only state, fed as two numbers
    (with the rows kept) through host arrays (`HostInputs`). ``device``, ``device_id``: where
    the buffers live ("cpu": numpy arrays, which are the OrtValues' own memory; "cuda": GPU
    memory)."""

    needs: tuple[str, ...] = ("seqlens_k", "total_length")
    rebuild_hint = ""

    def __init__(
        self,
        session: ort.InferenceSession,
        spec: ModelSpec,
        vocab_size: int,
        role: str,
        max_length: int | None = None,
        device: str = "cpu",
        device_id: int = 0,
    ) -> None:
        """``max_length`` caps the preallocated cache (and so the sequence length) below the
        model's max positions: a 128k-position model would otherwise reserve its whole cache."""
        io = spec.io
        kept, self._keep_sign = kept_rows_input(io)
        if not kept or not all(getattr(io, name) for name in self.needs):
            raise BundleError(f"{role}: {self.rebuild_hint}")
        super().__init__(session, spec, vocab_size, role, max_length)
        self.device, self.device_id = device, device_id
        self.length = 0
        binding = self._binding = session.io_binding()
        shape = (1, spec.num_kv_heads, self.max_positions, spec.head_dim)
        names = zip(
            [*io.past_keys, *io.past_values], [*io.present_keys, *io.present_values], strict=True
        )
        self._buffers: list[np.ndarray] = []  # on the CPU: the cache itself, kept alive
        self._cache: list[ort.OrtValue] = []
        for past, present in names:
            buffer = np.zeros(shape, NUMPY_DTYPES[spec.dtype])
            value = ort.OrtValue.ortvalue_from_numpy(buffer, device, device_id)
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
            self._cache.append(value)
            if device == "cpu":
                self._buffers.append(buffer)
        self._seqlens_k = np.zeros(1, dtype=np.int32)
        self._total_length = np.zeros((), dtype=np.int32)
        self._logits_to_keep = np.full(1, self._keep_sign, dtype=np.int64)
        self._inputs = HostInputs(binding, device, device_id)
        self._inputs.bind(io.seqlens_k, self._seqlens_k)
        # Read on the host by CUDA's kernels (GroupQueryAttention's total, Slice's start).
        self._inputs.bind(io.total_length, self._total_length, on_host=True)
        self._inputs.bind(kept, self._logits_to_keep, on_host=True)

    def reset(self) -> None:
        self.length = 0

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` positions (the rest is overwritten by later calls)."""
        self.length = min(self.length, length)

    def _advance(self, count: int) -> int:
        """Check room for ``count`` new positions and set the lengths the next call sees."""
        total = self.length + count
        self._check_room(self.length, count)
        self._seqlens_k[0] = total - 1
        self._total_length.fill(total)
        return total


class InPlaceDecoder(InPlaceBase):
    """Runs an in-place-cache graph on new tokens after its cached prefix; returns their logits."""

    rebuild_hint = (
        "this in-place cache engine has the inputs of engines built by earlier versions of "
        "specrt (an attention mask, or no rows kept); rebuild the bundle's engines with "
        "`specrt build --bundle DIR` (or run it with engine 'portable')"
    )

    def __init__(
        self,
        session: ort.InferenceSession,
        spec: ModelSpec,
        vocab_size: int,
        role: str,
        max_length: int | None = None,
    ) -> None:
        super().__init__(session, spec, vocab_size, role, max_length)
        # The graph's softmax is the distribution only if it spans exactly the vocabulary.
        self._with_probabilities = bool(spec.io.probabilities) and spec.vocab_size == vocab_size
        self._shapes: dict[tuple[int, int], _CallArrays] = {}
        self._memory = OutputMemory()  # every shape's logits (and probabilities)
        self._bound: _CallArrays | None = None

    def forward(
        self, tokens: Sequence[int], keep_last: int = 0, need: str = NEED_LOGITS
    ) -> Forward:
        """Logits (and probabilities) of the last ``keep_last`` positions fed, all by default;
        written into arrays the next call writes again (`OutputMemory`)."""
        count = len(tokens)
        total = self._advance(count)
        arrays = self._bound
        shape = (count, keep_last or count)
        if arrays is None or arrays.shape != shape:
            arrays = self._bind(*shape)
        arrays.ids[0] = tokens
        self._timed(self.session.run_with_iobinding, self._binding)
        self.length = total
        return arrays.result

    def _bind(self, count: int, keep_last: int) -> _CallArrays:
        arrays = self._shapes.get((count, keep_last))
        if arrays is None:
            grown, vocab = self._memory.grown, self.spec.vocab_size
            # a call of many tokens is not repeated: outputs of its own, freed with it
            memory = self._memory if count <= MAX_KEPT_CALL_TOKENS else OutputMemory()
            arrays = _CallArrays(
                count, keep_last, vocab, self.vocab_size, self._with_probabilities, memory
            )
            if self._memory.grown != grown:  # the other shapes' views hold the smaller buffers
                self._shapes.clear()
            if count <= MAX_KEPT_CALL_TOKENS:
                self._shapes[arrays.shape] = arrays
        io, binding = self.spec.io, self._binding
        self._logits_to_keep[0] = self._keep_sign * keep_last
        binding.bind_ortvalue_input(io.input_ids, arrays.values[0])
        binding.bind_ortvalue_output(io.logits, arrays.values[1])
        if self._with_probabilities:
            binding.bind_ortvalue_output(io.probabilities, arrays.values[2])
        self._bound = arrays
        return arrays


class _CallArrays:
    """The arrays one call shape binds: ``count`` token ids ``[1, count]``, logits and
    probabilities of the last ``keep_last`` positions ``[1, keep_last, graph vocab]``, and the
    `Forward` of row views cut to the vocabulary that the decoder hands out."""

    def __init__(
        self,
        count: int,
        keep_last: int,
        graph_vocab: int,
        vocab: int,
        probabilities: bool,
        memory: OutputMemory,
    ) -> None:
        self.shape = (count, keep_last)
        self.ids = np.zeros((1, count), dtype=np.int64)
        logits = memory.array("logits", (1, keep_last, graph_vocab))
        arrays = [self.ids, logits]
        self.result = Forward(logits[0, :, :vocab])
        if probabilities:
            arrays.append(memory.array("probabilities", (1, keep_last, graph_vocab)))
            self.result.probabilities = arrays[-1][0]
        self.values = [shared_ortvalue(a) for a in arrays]

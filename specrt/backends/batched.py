"""The onnxruntime engine's decoder for many rows at once: each call feeds S tokens to each of B
rows, every row after its own cached prefix.

The graph (``cache == "batched"``) keeps one cache buffer per layer and kind,
``[max_batch, capacity, kv_heads * head_dim]``, bound as both past and present: it writes each
new token's k and v at ``(row, position)`` (``cache_indices``) and attends under a mask of the
slots each token may see. The host owns the lengths: a row's state is ``lengths[row]``, and
rolling it back is lowering that number (later calls overwrite the stale slots).

Attention reads the whole buffer, so its capacity grows with the longest row (in steps of
`rows.CAPACITY_STEP`, up to ``max_length``) rather than being reserved at ``max_length`` up front.
A call covers rows ``start .. start + n``, a contiguous view of the buffers: the scheduler keeps
its live rows packed at the front (`move_row`). A call on one row sees only the first positions
of its row (`VIEW_STEP` past its length: also a contiguous view), so a row pays for its own
length, not for the capacity.

Row 0 alone is also a `Decoder` (``length``, ``forward``, ``rollback`` …), so the one-row loop
runs on this engine unchanged.

What every decoder of many rows does (lengths, growing and shrinking the cache, moving a row,
grouping rows into calls) is `RowsDecoder`'s, in `specrt.backends.rows`; this module holds the
graph's side: the cache's memory, the views each call binds, and each call's inputs (`_CallArrays`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import onnxruntime as ort

import specrt.backends.rows as rows  # its CAPACITY_STEP read at each init (tests patch it there)
from specrt.backends.base import (
    NEED_LOGITS,
    PAIR_ROWS,
    Forward,
    OutputMemory,
    kept_rows_input,
    shared_ortvalue,
)
from specrt.backends.host_inputs import HostInputs
from specrt.backends.rows import RowsDecoder
from specrt.bundle import ModelSpec
from specrt.errors import BundleError

MAX_KEPT_CALL_TOKENS = 80  # calls of at most this many tokens per row keep their arrays
SMALL_CALL = 16  # positions per call up to which the host writes its inputs in plain Python
VIEW_STEP = 32  # a one-row call's view of its row grows in steps of this many positions
MAX_KEPT_VIEWS = 256  # sets of cache values kept for the rows and views calls bound


class BatchedDecoder(RowsDecoder):
    """Runs a batched-cache graph on ``[rows, tokens]`` after each row's cached prefix."""

    device, device_id = "cpu", 0  # where the cache lives (`DeviceRowsDecoder`: on a GPU)

    def __init__(
        self,
        session: ort.InferenceSession,
        spec: ModelSpec,
        vocab_size: int,
        role: str,
        max_length: int | None = None,
        max_batch: int = 1,
    ) -> None:
        io = spec.io
        kept, self._keep_sign = kept_rows_input(io)
        if not (io.position_ids and io.cache_indices and io.attention_mask and kept):
            raise BundleError(
                f"{role}: the batched engine lacks position_ids / cache_indices / attention_mask"
                " inputs; rebuild the bundle's engines with `specrt build --bundle DIR`"
            )
        super().__init__(session, spec, vocab_size, role, max_length, max_batch)
        self._with_probabilities = bool(io.probabilities) and spec.vocab_size == vocab_size
        self._width = spec.num_kv_heads * spec.head_dim
        self.window = spec.sliding_window  # positions a token attends to, at most
        # Local and global layers: the window goes into the local layers' mask only.
        self._local = bool(io.local_attention_mask)
        # A graph attending by each row's length (`kv_lengths`): its padding needs its slots.
        self._by_length = bool(io.kv_lengths)
        self._binding = session.io_binding()
        self._rows: tuple[int, int, int] | None = None  # rows and positions the binding covers
        self._shapes: dict[tuple[int, int, int], _CallArrays] = {}
        self._memory = OutputMemory()  # every shape's logits (and probabilities)
        self._bound: _CallArrays | None = None
        self._views: dict[tuple[int, int, int], list] = {}  # (start, n, width): cache values
        self._blocks: list[np.ndarray] = []  # the memory the buffers are views on (`_resized`)
        self._block_capacity = 0
        self._logits_to_keep = np.full(1, self._keep_sign, dtype=np.int64)
        self._inputs = HostInputs(self._binding, self.device, self.device_id)
        self._inputs.bind(kept, self._logits_to_keep, on_host=True)  # Slice's start, on CUDA
        self._pair_rows: np.ndarray | None = None
        if PAIR_ROWS in {node.name for node in session.get_inputs()}:
            self._pair_rows = np.ones(1, dtype=np.int64)  # read by every run, as written now
            self._inputs.bind(PAIR_ROWS, self._pair_rows)
        self._grow(min(self.max_positions, rows.CAPACITY_STEP))

    @property
    def can_unpair_rows(self) -> bool:
        """Whether the graph computes a copy of an odd call's last position only when told."""
        return self._pair_rows is not None

    def pair_rows(self, on: bool) -> None:
        """Compute a copy of an odd call's last position (``on``) or not; the spec says which
        (``even_rows``), so the draft schedule prices calls as they now run."""
        if self._pair_rows is None:
            raise ValueError(f"{self.role}: the graph always computes even counts")
        self._pair_rows[0] = int(on)
        self.spec = replace(self.spec, even_rows=on)

    def forward(
        self, tokens: Sequence[int], keep_last: int = 0, need: str = NEED_LOGITS
    ) -> Forward:
        count = len(tokens)
        arrays = self._prepare(0, 1, count, keep_last or count, need)
        arrays.ids[0] = tokens
        self._run(0, 1, count)
        return arrays.row_result

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
        """``hidden [n, S, width]``: an EAGLE head's input features."""
        arrays = self._prepare(start, n, tokens.shape[1], keep_last, need, fed)
        arrays.ids[...] = tokens
        if hidden is not None:
            arrays.hidden[...] = hidden
        self._run(start, n, fed)
        return arrays.result

    def _buffer_shape(self, capacity: int) -> tuple[int, ...]:
        return (self.max_batch, capacity, self._width)

    def _resized(self, capacity: int) -> list:
        """The buffers at ``capacity`` positions, content kept, as views on one block of memory
        per buffer that is kept for the largest capacity yet, the rows moved within it. A fresh
        allocation faults every page in again at its first writes, which costs several times
        moving the rows within memory already touched (CHANGELOG.md, 2026-12-01)."""
        shape = self._buffer_shape(capacity)
        if capacity > self._block_capacity:  # new memory, written (its pages mapped) at once
            blocks = [np.full(int(np.prod(shape)), 0, self._dtype) for _ in self._names]
            buffers = [block.reshape(shape) for block in blocks]
            window = (slice(None), slice(0, self.capacity))
            for new, previous in zip(buffers, self._buffers):
                new[window] = previous
            self._blocks, self._block_capacity = blocks, capacity
            return buffers
        old, keep = self.capacity, min(self.capacity, capacity)
        # Growing, a row's new place starts past its old one: move the last row first; shrinking,
        # the first (no row lands on one not moved yet). Only the rows' cached positions move:
        # the slots past them hold finite leftovers of the block, masked until overwritten.
        order = range(self.max_batch - 1, -1, -1) if capacity > old else range(self.max_batch)
        lengths = self.moved_lengths(keep)
        buffers = []
        for block, previous in zip(self._blocks, self._buffers):
            new = block[: int(np.prod(shape))].reshape(shape)
            for row in order:
                if lengths[row]:
                    new[row, : lengths[row]] = previous[row, : lengths[row]]
            buffers.append(new)
        return buffers

    def _grow(self, needed: int) -> None:
        super()._grow(needed)
        self._bound = None  # bound again at the next call (its masks fitted to the capacity)
        self._rows = None
        self._views.clear()

    def reserve(self) -> None:
        """Grow to ``max_positions`` and back: the memory stays (`_resized`), so no later growth
        allocates it in the middle of a round (a service's first growth held every running
        request while it did). One row's engine keeps its capacity anyway."""
        if self.max_batch > 1 and self._block_capacity < self.max_positions:
            capacity = self.capacity
            self._grow(self.max_positions)
            self._grow(capacity)

    def shrink(self, headroom: int = 0, keep: int = 0) -> None:
        """Not with one row: its calls see its own positions only (`VIEW_STEP`), so a
        capacity kept after a long row costs nothing, and regrowing it costs copies."""
        if self.max_batch > 1:
            super().shrink(headroom, keep)

    # ---------------------------------------------------------------------------------------
    def _prepare(
        self,
        start: int,
        n: int,
        count: int,
        keep_last: int,
        need: str = NEED_LOGITS,
        fed: int | np.ndarray | None = None,
    ) -> _CallArrays:
        """Check room, grow the cache if a row's tokens would pass its capacity, write the
        rows' positions, cache indices and mask, and bind the arrays of this call's shape.

        Padding (a row's positions past its ``fed`` real tokens) does not grow the cache: its
        keys and values land in the last slot, past every real token, where nothing reads them
        before a real token overwrites them (a long row padded in a wide round would otherwise
        double the capacity every row attends over)."""
        lengths = self.lengths[start : start + n].tolist()
        longest = max(lengths)
        self._check_room(longest, count)
        if self.kept_positions:  # the call writes these slots: a finished row kept there goes
            for slot in range(start, start + n):
                self.kept_positions.pop(slot, None)
        if longest + count > self.capacity:
            real_end = longest + count
            padded = fed is not None and not isinstance(fed, int)  # rows past their tokens
            if padded and not self._by_length:  # (by length, padding is attended over)
                real_end = int(np.max(self.lengths[start : start + n] + fed))
            if real_end >= self.capacity:  # a real token needs the slots (or the last one)
                self._grow(longest + count)
        width = self.capacity
        if n == 1:  # its row's first positions are contiguous: attend over those only
            width = min(width, -(-(longest + count) // VIEW_STEP) * VIEW_STEP)
        if self._rows != (start, n, width):
            self._bind_rows(start, n, width)
        arrays = self._bound
        key = self._call_key(n, count, keep_last, need)
        if arrays is None or arrays.key != key or arrays.capacity != width:
            arrays = self._bind(key, width)
        if self._by_length:  # every row's keys after the call, its padding's included
            np.add(self.lengths[start : start + n], count, out=arrays.kv_lengths)
        if n * count > SMALL_CALL:
            np.add(self.lengths[start : start + n, None], arrays.steps, out=arrays.positions)
            np.minimum(arrays.positions, self.capacity - 1, out=arrays.indices[..., 1])
            np.less_equal(arrays.slots, arrays.positions[:, None, :, None], out=arrays.mask)
            windowed = arrays.mask
            if self._local:
                windowed = arrays.local_mask
                np.copyto(windowed, arrays.mask)
            if self.window:  # and only the last `window` positions
                oldest = arrays.positions[:, None, :, None] - self.window
                windowed &= arrays.slots > oldest
            return arrays
        # A few positions (a draft step, one row's verification): plain Python stores beat
        # numpy's per-call cost, which runs cold right after a model call.
        positions, indices, mask = arrays.positions, arrays.indices, arrays.mask
        last = self.capacity - 1
        for row, length in enumerate(lengths):
            for step in range(count):
                position = length + step
                positions[row, step] = position
                indices[row, step, 1] = min(position, last)
                visible = mask[row, 0, step]
                visible[: position + 1] = True
                visible[position + 1 :] = False
                if self._local:
                    arrays.local_mask[row, 0, step] = visible
                    visible = arrays.local_mask[row, 0, step]
                if self.window:
                    visible[: max(0, position + 1 - self.window)] = False
        return arrays

    def _run(self, start: int, n: int, fed: int | np.ndarray) -> None:
        self._execute()
        if self._feature_width:
            self._keep_features(start, n, fed, self._bound.features)
        if n == 1 and isinstance(fed, int):
            self.lengths[start] += fed
        else:
            self.lengths[start : start + n] += fed

    def _execute(self) -> None:
        """Run the bound call; its host outputs are written when this returns."""
        self._timed(self.session.run_with_iobinding, self._binding)

    def _bind_rows(self, start: int, n: int, width: int) -> None:
        key = (start, n, width)
        values = self._views.get(key)
        if values is None:
            if len(self._views) >= MAX_KEPT_VIEWS:
                self._views.clear()
            views = (buffer[start : start + n, :width] for buffer in self._buffers)
            values = self._views[key] = [shared_ortvalue(view) for view in views]
        for (past, present), value in zip(self._names, values):
            self._binding.bind_ortvalue_input(past, value)
            self._binding.bind_ortvalue_output(present, value)
        self._rows = key

    def _call_key(self, n: int, count: int, keep_last: int, need: str) -> tuple:
        """What a call's arrays depend on: on the host every output comes back, whatever is
        needed."""
        return n, count, keep_last

    def _new_arrays(self, key: tuple, width: int) -> _CallArrays:
        arrays = _CallArrays(key[:3], width, self._local)
        grown = self._memory.grown
        # A call of many tokens (a prompt's log-probabilities) is not repeated: its outputs are
        # its own, and freed with it, not a size the shared buffer keeps.
        memory = self._memory if key[1] <= MAX_KEPT_CALL_TOKENS else OutputMemory()
        probabilities = self._with_probabilities
        arrays.host_outputs(self.spec.vocab_size, self.vocab_size, probabilities, memory)
        if self._memory.grown != grown:  # the other shapes' views hold the smaller buffers
            self._shapes.clear()
        arrays.eagle_arrays(self._feature_width, self._hidden_width)
        return arrays

    def _bind(self, key: tuple, width: int) -> _CallArrays:
        """Bind the arrays of call shape ``key`` with masks over ``width`` positions."""
        arrays = self._shapes.get(key)
        if arrays is None:
            arrays = self._new_arrays(key, width)
            arrays.key = key
            if key[1] <= MAX_KEPT_CALL_TOKENS:
                self._shapes[key] = arrays
        elif arrays.capacity != width:  # the cache or the row's view grew or shrank since
            arrays.fit(width)
        io, inputs = self.spec.io, self._inputs
        self._logits_to_keep[0] = self._keep_sign * key[2]
        inputs.bind(io.input_ids, arrays.ids, arrays.values[0])
        inputs.bind(io.position_ids, arrays.positions, arrays.values[1])
        inputs.bind(io.cache_indices, arrays.indices, arrays.values[2])
        inputs.bind(io.attention_mask, arrays.mask, arrays.values[3])
        for name, value in arrays.outputs.items():
            self._binding.bind_ortvalue_output(getattr(io, name), value)
        if self._local:
            inputs.bind(io.local_attention_mask, arrays.local_mask, arrays.local_value)
        if self._by_length:
            inputs.bind(io.kv_lengths, arrays.kv_lengths, arrays.kv_value)
        if self._hidden_width:
            inputs.bind(io.hidden_states, arrays.hidden, arrays.hidden_value)
        self._bound = arrays
        return arrays


class _CallArrays:
    """The arrays one call shape ``(rows, tokens, kept)`` binds: its inputs, and its outputs
    (``outputs``: name in `ModelIO` -> value) with the `Forward`s handed out: ``result`` with
    ``[rows, kept, vocab]`` arrays, ``row_result`` with row 0's ``[kept, vocab]``."""

    def __init__(self, shape: tuple[int, int, int], capacity: int, local_mask: bool) -> None:
        n, count, keep_last = self.shape = shape
        self.key: tuple = shape
        self.ids = np.zeros((n, count), dtype=np.int64)
        self.steps = np.arange(count, dtype=np.int64)
        self.positions = np.zeros((n, count), dtype=np.int64)
        self.indices = np.zeros((n, count, 2), dtype=np.int64)
        self.indices[..., 0] = np.arange(n)[:, None]
        self.values = [shared_ortvalue(a) for a in (self.ids, self.positions, self.indices)]
        self.kv_lengths = np.zeros(n, dtype=np.int64)
        self.kv_value = shared_ortvalue(self.kv_lengths)
        self._local = local_mask
        self.fit(capacity)
        self.outputs: dict[str, ort.OrtValue] = {}
        self.result = self.row_result = Forward(None)

    def fit(self, capacity: int) -> None:
        """The masks for a cache of ``capacity`` positions (the call writes them whole)."""
        n, count, _ = self.shape
        self.capacity = capacity
        self.slots = np.arange(capacity, dtype=np.int64)
        self.mask = np.zeros((n, 1, count, capacity), dtype=bool)
        self.values[3:] = [shared_ortvalue(self.mask)]
        if self._local:  # the local layers' mask
            self.local_mask = np.zeros_like(self.mask)
            self.local_value = shared_ortvalue(self.local_mask)

    def host_outputs(
        self, graph_vocab: int, vocab: int, probabilities: bool, memory: OutputMemory
    ) -> None:
        """The logits (and the graph's softmax) into host arrays of ``memory``, cut to
        ``vocab``."""
        n, _, keep_last = self.shape
        logits = memory.array("logits", (n, keep_last, graph_vocab))
        self.outputs["logits"] = shared_ortvalue(logits)
        self.result = Forward(logits[:, :, :vocab])
        self.row_result = Forward(logits[0, :, :vocab])
        if probabilities:
            kept = memory.array("probabilities", (n, keep_last, graph_vocab))
            self.outputs["probabilities"] = shared_ortvalue(kept)
            self.result.probabilities = kept[:, :, :vocab]
            self.row_result.probabilities = kept[0, :, :vocab]

    def eagle_arrays(self, features: int, hidden: int) -> None:
        """A target's features of every position fed ``[rows, tokens, features]``; an EAGLE
        head's input features ``[rows, tokens, hidden]`` and hidden states out ``[rows, kept,
        hidden]``."""
        n, count, keep_last = self.shape
        if features:
            self.features = np.empty((n, count, features), dtype=np.float32)
            self.outputs["features"] = shared_ortvalue(self.features)
        if hidden:
            self.hidden = np.zeros((n, count, hidden), dtype=np.float32)
            self.hidden_value = shared_ortvalue(self.hidden)
            out = np.empty((n, keep_last, hidden), dtype=np.float32)
            self.outputs["hidden_out"] = shared_ortvalue(out)
            self.result.hidden, self.row_result.hidden = out, out[0]

"""The onnxruntime engine's decoder for many rows at once: each call feeds S tokens to each of B
rows, every row after its own cached prefix.

The graph (``cache == "batched"``) keeps one cache buffer per layer and kind,
``[max_batch, capacity, kv_heads * head_dim]``, bound as both past and present: it writes each
new token's k and v at ``(row, position)`` (``cache_indices``) and attends under a mask of the
slots each token may see. The host owns the lengths: a row's state is ``lengths[row]``, and
rolling it back is lowering that number (later calls overwrite the stale slots).

Attention reads the whole buffer, so its capacity grows with the longest row (in steps of
`CAPACITY_STEP`, up to ``max_length``) rather than being reserved at ``max_length`` up front.
A call covers rows ``start .. start + n``, a contiguous view of the buffers: the scheduler keeps
its live rows packed at the front (`move_row`). A call on one row sees only the first positions
of its row (`VIEW_STEP` past its length: also a contiguous view), so a row pays for its own
length, not for the capacity.

Row 0 alone is also a `Decoder` (``length``, ``forward``, ``rollback`` …), so the one-row loop
runs on this engine unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from specrt.backends.base import (
    NEED_ARGMAX,
    NEED_LOGITS,
    NUMPY_DTYPES,
    PREFILL_CHUNK,
    DecoderBase,
    Forward,
    kept_rows_input,
    shared_ortvalue,
)
from specrt.backends.host_inputs import HostInputs
from specrt.bundle import ModelSpec
from specrt.errors import BundleError

# Cache positions added at a time. Calls on several rows attend over the whole capacity (16
# demo rows: ~7.5 us a position a target step) and a resize moves the rows (2-5 ms): steps of
# 32 balance the two for a longest row that grows a token or a few a round.
CAPACITY_STEP = 32
# A cache of one row grows in larger steps: that row's calls see only its own positions
# (`VIEW_STEP`), so its capacity costs memory, not compute, and each resize copies the row.
ONE_ROW_CAPACITY_STEP = 256
MAX_KEPT_CALL_TOKENS = 80  # calls of at most this many tokens per row keep their arrays
SMALL_CALL = 16  # positions per call up to which the host writes its inputs in plain Python
VIEW_STEP = 32  # a one-row call's view of its row grows in steps of this many positions
MAX_KEPT_VIEWS = 256  # sets of cache values kept for the rows and views calls bound
# What a call costs beyond its positions, in positions (demo pair on 2 cores: a one-row call
# 0.6 ms on the target, 55 us a position in long calls; 0.05 ms and 8 us on the draft).
CALL_OVERHEAD = 12
MAX_RUN = 64  # rows a run of `padded_runs` spans at most (its search grows with it)


def padded_runs(counts: Sequence[int], overhead: int = CALL_OVERHEAD) -> list[tuple[int, int]]:
    """Runs ``[first, end)`` of neighbouring rows that cover every row with a count above 0, for
    calls that pad each row to its run's longest: the fewest positions computed, counting
    ``overhead`` positions per call. One row far behind its neighbours is fed alone, not with
    all of them padded to its length."""
    n = len(counts)
    cost = [0] * (n + 1)  # cost[b]: rows before b covered
    cut: list[int | None] = [None] * (n + 1)  # where the run ending at b starts (None: skipped)
    for end in range(1, n + 1):
        cost[end] = cost[end - 1] if counts[end - 1] == 0 else 1 << 62
        longest = 0
        for first in range(end - 1, max(-1, end - 1 - MAX_RUN), -1):
            longest = max(longest, counts[first])
            here = cost[first] + (end - first) * longest + overhead
            if longest and here < cost[end]:
                cost[end], cut[end] = here, first
    runs, end = [], n
    while end > 0:
        first = cut[end]
        if first is None:
            end -= 1
        else:
            runs.append((first, end))
            end = first
    return runs[::-1]


class RowsDecoder(DecoderBase):
    """What the decoders of many rows share: per-row lengths, one cache buffer per layer and
    kind whose position axis (``POSITION_AXIS``) grows with the longest row, the one-row
    `Decoder` protocol on row 0, prefilling rows together, moving a row. Subclasses provide
    ``_buffer_shape(capacity)`` and ``_call(start, n, tokens, keep_last, fed) -> Forward``."""

    POSITION_AXIS = 1

    def __init__(
        self,
        session: ort.InferenceSession,
        spec: ModelSpec,
        vocab_size: int,
        role: str,
        max_length: int | None = None,
        max_batch: int = 1,
    ) -> None:
        """``max_batch`` rows get a cache; ``max_length`` caps each row's positions."""
        super().__init__(session, spec, vocab_size, role, max_length)
        io = spec.io
        self.max_batch = max_batch
        self.lengths = np.zeros(max_batch, dtype=np.int64)
        self._names = list(
            zip([*io.past_keys, *io.past_values], [*io.present_keys, *io.present_values])
        )
        self._dtype = NUMPY_DTYPES[spec.dtype]
        self._buffers: list[np.ndarray] = []
        self.capacity = 0
        self.resizes = 0  # times the cache was reallocated (a round that did is not a typical one)

    @property
    def cache_bytes_per_row(self) -> int:
        """Cache memory one row takes at ``max_positions`` (what a slot can grow to)."""
        per_position = int(np.prod(self._buffer_shape(1))) // self.max_batch
        return len(self._names) * self.max_positions * per_position * self._dtype().itemsize

    @property
    def cache_bytes(self) -> int:
        """Cache memory reserved now, all rows."""
        return sum(buffer.nbytes for buffer in self._buffers)

    # The one-row `Decoder` protocol, on row 0 ---------------------------------------------
    @property
    def length(self) -> int:
        return int(self.lengths[0])

    def reset(self) -> None:
        self.lengths[:] = 0
        self.shrink()

    def shrink(self, headroom: int = 0) -> None:
        """Give back the capacity steps no row needs, ``headroom`` positions past the longest
        row kept (so that it does not grow again at once): attention over several rows reads
        all of the capacity, so the rows after a long one would go on paying for its positions."""
        longest, step = int(self.lengths.max(initial=0)), self._capacity_step()
        steps = max(1, -(-(longest + headroom if longest else 0) // step))
        capacity = min(self.max_positions, steps * step)
        if self.capacity > capacity:
            self._grow(capacity)

    def reserve(self) -> None:
        """Take the memory of the largest capacity now rather than when a row first needs it
        (an engine that keeps it: `BatchedDecoder`)."""

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` positions of row 0."""
        self.lengths[0] = min(self.lengths[0], length)

    def forward(
        self, tokens: Sequence[int], keep_last: int = 0, need: str = NEED_LOGITS
    ) -> Forward:
        tokens = np.asarray([tokens], dtype=np.int64)
        out = self._call(0, 1, tokens, keep_last or tokens.shape[1], len(tokens[0]), need)
        probabilities = None if out.probabilities is None else out.probabilities[0]
        return Forward(out.logits[0], probabilities)

    # Rows ---------------------------------------------------------------------------------
    def prefill_rows(self, start: int, prompts: list[Sequence[int]]) -> None:
        """Feed ``prompts[i]`` to row ``start + i`` after its cached positions (a prompt, or the
        tokens a draft skipped), logits dropped. Rows are fed in calls over runs of neighbours
        (`padded_runs`), each padded at its end to its run's longest, one call per
        `PREFILL_CHUNK` positions; a row with nothing to feed is left out."""
        for row, prompt in enumerate(prompts):
            self._check_room(int(self.lengths[start + row]), len(prompt))
        for first, end in padded_runs([len(prompt) for prompt in prompts]):
            run = prompts[first:end]
            longest = max(map(len, run))
            for offset in range(0, longest, PREFILL_CHUNK):
                width = min(PREFILL_CHUNK, longest - offset)
                tokens = np.zeros((len(run), width), dtype=np.int64)
                fed = np.zeros(len(run), dtype=np.int64)
                for row, prompt in enumerate(run):
                    chunk = prompt[offset : offset + width]
                    tokens[row, : len(chunk)] = chunk
                    fed[row] = len(chunk)
                # the least to bring back (a device engine copies logits to the host)
                self._call(start + first, len(run), tokens, 1, fed, NEED_ARGMAX)

    def forward_rows(
        self,
        tokens: np.ndarray,
        keep_last: int = 0,
        fed: np.ndarray | None = None,
        start: int = 0,
        need: str = NEED_LOGITS,
    ) -> Forward:
        """Feed ``tokens [n, S]`` to rows ``start .. start + n - 1``, each after its own
        prefix; logits ``[n, keep_last, vocab]`` (and probabilities, where the graph has them)
        of the last ``keep_last`` positions (a device backend: only what ``need`` names, the
        argmax ``[n, keep_last]``). ``fed [n]``: how many of its S tokens each row really has
        (default S): the rest are padding at its end, computed and then dropped (the row's
        length grows by ``fed``)."""
        n, count = tokens.shape
        fed = count if fed is None else fed
        return self._call(start, n, tokens, keep_last or count, fed, need)

    def set_length(self, row: int, length: int) -> None:
        """Keep only the first ``length`` positions of ``row`` (0: the row is free)."""
        self.lengths[row] = min(self.lengths[row], length)

    def clear_stale(self) -> None:
        """Zero every row's cache past its length (after a row's logits came out NaN): a
        masked slot still enters attention's product with weight 0, and 0 x NaN is NaN, so NaN
        left by a failed row, or by another row's padding in a call it shared, would reach the
        next row given that slot."""
        before = (slice(None),) * (self.POSITION_AXIS - 1)
        for buffer in self._buffers:
            for row, length in enumerate(self.lengths.tolist()):
                buffer[(row, *before, slice(length, None))] = 0

    def move_row(self, source: int, dest: int) -> None:
        """Copy ``source``'s cache and length into ``dest`` (packing live rows at the front)."""
        length = int(self.lengths[source])
        window = (slice(None),) * (self.POSITION_AXIS - 1) + (slice(0, length),)
        for buffer in self._buffers:
            buffer[(dest, *window)] = buffer[(source, *window)]
        self.lengths[dest] = length
        self.lengths[source] = 0

    def _grow(self, needed: int) -> None:
        """Reallocate the cache with room for ``needed`` positions per row (fewer than now:
        `shrink`), keeping its content."""
        step = self._capacity_step()
        capacity = min(self.max_positions, -(-needed // step) * step)
        self._buffers = self._resized(capacity)
        self.capacity = capacity
        self.resizes += 1

    def _capacity_step(self) -> int:
        """Positions the cache grows by at a time."""
        return CAPACITY_STEP if self.max_batch > 1 else ONE_ROW_CAPACITY_STEP

    def _resized(self, capacity: int) -> list:
        """New zeroed buffers of ``capacity`` positions holding the current ones' content."""
        buffers = [np.zeros(self._buffer_shape(capacity), self._dtype) for _ in self._names]
        window = (slice(None),) * self.POSITION_AXIS + (slice(0, min(capacity, self.capacity)),)
        for new, previous in zip(buffers, self._buffers):
            new[window] = previous[window]
        return buffers

    def _buffer_shape(self, capacity: int) -> tuple[int, ...]:
        raise NotImplementedError

    def _call(
        self,
        start: int,
        n: int,
        tokens: np.ndarray,
        keep_last: int,
        fed: int | np.ndarray,
        need: str = NEED_LOGITS,
    ) -> Forward:
        raise NotImplementedError


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
        self._binding = session.io_binding()
        self._rows: tuple[int, int, int] | None = None  # rows and positions the binding covers
        self._shapes: dict[tuple[int, int, int], _CallArrays] = {}
        self._bound: _CallArrays | None = None
        self._views: dict[tuple[int, int, int], list] = {}  # (start, n, width): cache values
        self._blocks: list[np.ndarray] = []  # the memory the buffers are views on (`_resized`)
        self._block_capacity = 0
        self._logits_to_keep = np.full(1, self._keep_sign, dtype=np.int64)
        self._inputs = HostInputs(self._binding, self.device, self.device_id)
        self._inputs.bind(kept, self._logits_to_keep, on_host=True)  # Slice's start, on CUDA
        self._grow(min(self.max_positions, CAPACITY_STEP))

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
    ) -> Forward:
        arrays = self._prepare(start, n, tokens.shape[1], keep_last, need, fed)
        arrays.ids[...] = tokens
        self._run(start, n, fed)
        return arrays.result

    def _buffer_shape(self, capacity: int) -> tuple[int, ...]:
        return (self.max_batch, capacity, self._width)

    def _resized(self, capacity: int) -> list:
        """The buffers at ``capacity`` positions, content kept, as views on one block of memory
        per buffer that is kept for the largest capacity yet, the rows moved within it. A fresh
        allocation faults every page in again at its first writes: 40-60 ms to grow a 16-row
        demo cache on this project's VMs, against ~5 ms to move the rows."""
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
        lengths = np.minimum(self.lengths, keep).tolist()
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
        allocates it in the middle of a round (a service's first growth to 512 positions held
        16 demo rows for 56-69 ms). One row's engine keeps its capacity anyway."""
        if self.max_batch > 1 and self._block_capacity < self.max_positions:
            capacity = self.capacity
            self._grow(self.max_positions)
            self._grow(capacity)

    def shrink(self, headroom: int = 0) -> None:
        """Not with one row: its calls see its own positions only (`VIEW_STEP`), so a
        capacity kept after a long row costs nothing, and regrowing it costs copies."""
        if self.max_batch > 1:
            super().shrink(headroom)

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
        if longest + count > self.capacity:
            real_end = longest + count
            if fed is not None and not isinstance(fed, int):  # rows padded past their tokens
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
        self._timed(self.session.run_with_iobinding, self._binding)
        if n == 1 and isinstance(fed, int):
            self.lengths[start] += fed
        else:
            self.lengths[start : start + n] += fed

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
        arrays.host_outputs(self.spec.vocab_size, self.vocab_size, self._with_probabilities)
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

    def host_outputs(self, graph_vocab: int, vocab: int, probabilities: bool) -> None:
        """The logits (and the graph's softmax) into host arrays, cut to ``vocab``."""
        n, _, keep_last = self.shape
        logits = np.empty((n, keep_last, graph_vocab), dtype=np.float32)
        self.outputs["logits"] = shared_ortvalue(logits)
        self.result = Forward(logits[:, :, :vocab])
        self.row_result = Forward(logits[0, :, :vocab])
        if probabilities:
            kept = np.empty((n, keep_last, graph_vocab), dtype=np.float32)
            self.outputs["probabilities"] = shared_ortvalue(kept)
            self.result.probabilities = kept[:, :, :vocab]
            self.row_result.probabilities = kept[0, :, :vocab]

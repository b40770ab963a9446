"""What the decoders of many rows share (`RowsDecoder`): a length per row, one cache buffer per
layer and kind whose position axis grows with the longest row (in steps of `CAPACITY_STEP`) and
shrinks back when no row needs the steps, the one-row `Decoder` protocol on row 0, prefilling rows
together and moving a row; and `padded_runs`, how rows of different lengths are grouped into
calls. The onnxruntime engine's `BatchedDecoder` (`specrt.backends.batched`) and the portable
graph's rows build on it.

A module constant is patched where it is read: the capacity steps are read here when a cache
grows (and by `BatchedDecoder` for its first step), ``PREFILL_CHUNK`` by `prefill_rows`, so a
test that wants small steps or chunks patches them on this module (`VIEW_STEP`: on `batched`).
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
)
from specrt.bundle import ModelSpec

# Cache positions added at a time. Calls on several rows attend over the whole capacity (every
# spare position costs each step) and a resize moves the rows: steps of 32 balance the two for
# a longest row that grows a token or a few a round (CHANGELOG.md, 2026-12-01).
CAPACITY_STEP = 32
# A cache of one row grows in larger steps: that row's calls see only its own positions
# (`batched.VIEW_STEP`), so its capacity costs memory, not compute, and each resize copies the row.
ONE_ROW_CAPACITY_STEP = 256
# What a call costs beyond its positions, in positions: a call's fixed cost over one position's
# in long calls, on the demo pair on 2 cores (CHANGELOG.md, 2026-12-01).
CALL_OVERHEAD = 12
MAX_RUN = 64  # rows a run of `padded_runs` spans at most (its search grows with it)


def graph_width(session: ort.InferenceSession, name: str | None) -> int:
    """The last dimension of the graph's input or output ``name`` (0: the graph has none)."""
    if not name:
        return 0
    found = [v for v in (*session.get_inputs(), *session.get_outputs()) if v.name == name]
    return int(found[0].shape[-1]) if found else 0


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
    # As a draft, it may read a window of a long row, starting over at the row's last tokens
    # (`batching.BatchRunner._window`); an EAGLE head reads every position.
    windowed = True
    # As a draft, tokens beyond its newest that a round's first draft call still reads itself;
    # further behind, `round.catch_up` feeds them first (logits dropped). An EAGLE head reads
    # a round's verified positions in that call: one call, where two cost another run.
    catch_up_above = 1
    # Whether a row's cache can be copied into another slot (`copy_row`): what lets a prompt
    # copy the beginning it shares with a running or finished row (`prefixes`).
    copies_rows = True

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
        # Free slots whose first positions a caller keeps (`prefixes.KeptRows`), slot ->
        # positions: a resize moves them with the rows' own (`moved_lengths`); a call or a copy
        # that writes the slot, clearing, or a capacity below them gives them up here, where
        # the keeper reads what still holds.
        self.kept_positions: dict[int, int] = {}
        self._names = list(
            zip([*io.past_keys, *io.past_values], [*io.present_keys, *io.present_values])
        )
        self._dtype = NUMPY_DTYPES[spec.dtype]
        self._buffers: list[np.ndarray] = []
        self.capacity = 0
        self.resizes = 0  # times the cache was reallocated (a round that did is not a typical one)
        # A target with an EAGLE head keeps the head's features of every position it holds,
        # [rows, capacity, width] (`features`), as it keeps k and v; a head reads them there.
        self._feature_width = graph_width(session, io.features)
        self._hidden_width = graph_width(session, io.hidden_states)  # a head's input
        self.features = np.zeros((max_batch, 0, self._feature_width), dtype=np.float32)

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
        self.kept_positions.clear()
        self.shrink()

    def shrink(self, headroom: int = 0, keep: int = 0) -> None:
        """Give back the capacity steps no row needs, ``headroom`` positions past the longest
        row kept (so that it does not grow again at once), and never below ``keep`` positions
        (a finished row's, kept for prompts that begin as it did: `prefixes.KeptRows`):
        attention over several rows reads all of the capacity, so the rows after a long one
        would go on paying for its positions."""
        longest, step = int(self.lengths.max(initial=0)), self._capacity_step()
        needed = max(longest + headroom if longest else 0, keep)
        steps = max(1, -(-needed // step))
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
        self.kept_positions.clear()
        before = (slice(None),) * (self.POSITION_AXIS - 1)
        for buffer in self._buffers:
            for row, length in enumerate(self.lengths.tolist()):
                buffer[(row, *before, slice(length, None))] = 0

    def move_row(self, source: int, dest: int) -> None:
        """Move ``source``'s cache and length into ``dest`` (packing live rows at the front)."""
        self.copy_row(source, dest)
        self.lengths[source] = 0

    def copy_row(self, source: int, dest: int, length: int | None = None) -> None:
        """Copy ``source``'s cache and length into ``dest``, or its first ``length`` positions
        (a prefix the rows share); ``source`` keeps its own (rows with one prompt read it once)."""
        length = int(self.lengths[source]) if length is None else length
        self.kept_positions.pop(dest, None)
        if source == dest:  # a finished row's slot taken by a prompt that begins as it did
            self.lengths[dest] = length
            return
        self._copy_features(source, dest, length)
        window = (slice(None),) * (self.POSITION_AXIS - 1) + (slice(0, length),)
        for buffer in self._buffers:
            buffer[(dest, *window)] = buffer[(source, *window)]
        self.lengths[dest] = length

    def moved_lengths(self, capacity: int) -> list[int]:
        """Each slot's positions a resize to ``capacity`` keeps: a row's cached ones, or those
        of a finished row kept in a free slot."""
        lengths = np.minimum(self.lengths, capacity).tolist()
        for slot, positions in self.kept_positions.items():
            lengths[slot] = max(lengths[slot], min(positions, capacity))
        return lengths

    def _grow(self, needed: int) -> None:
        """Reallocate the cache with room for ``needed`` positions per row (fewer than now:
        `shrink`), keeping its content."""
        step = self._capacity_step()
        capacity = min(self.max_positions, -(-needed // step) * step)
        self._buffers = self._resized(capacity)
        self.capacity = capacity
        for slot, positions in list(self.kept_positions.items()):  # what the capacity holds
            self.kept_positions[slot] = min(positions, capacity)
        self.resizes += 1
        if self._feature_width:
            previous = self.features
            self.features = np.zeros((self.max_batch, capacity, self._feature_width), "f4")
            keep = min(capacity, previous.shape[1])
            self.features[:, :keep] = previous[:, :keep]

    # An EAGLE head's features, kept on the host whatever the graph runs on ------------------
    def _keep_features(self, start: int, n: int, fed: int | np.ndarray, computed) -> None:
        """Store ``computed [n, S, width]``, the features of a call's positions, at each row's
        real positions (``fed`` of them; the lengths not yet grown by the call)."""
        counts = [fed] * n if isinstance(fed, int) else np.broadcast_to(fed, n).tolist()
        lengths = self.lengths[start : start + n].tolist()
        for i, (length, count) in enumerate(zip(lengths, counts)):
            self.features[start + i, length : length + count] = computed[i, :count]

    def _copy_features(self, source: int, dest: int, length: int) -> None:
        if self._feature_width:
            self.features[dest, :length] = self.features[source, :length]

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

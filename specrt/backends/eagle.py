"""An EAGLE head as the round's draft: the head's engine and the target's features, seen as a
draft model's rows, so that the round engine drafts with it unchanged (`specrt.runtime.round`).

The head's slot p reads the features of position p and the token after it, ``tokens[p + 1]``,
and predicts ``tokens[p + 2]``. The features are the target's (`BatchedDecoder.features`: what
it computed at p) wherever the target holds p; past that, while chaining a round's drafts, the
head's own hidden state of slot p - 1. So a row's first token needs no slot, and in the row's
token space (the one the runner and the round count in) the head has read ``slots + 1``
tokens: that is its ``lengths``.

Slots read from the head's own states are the round's guesses: when the round is over, the
head keeps only the slots read from the target's features (`set_length`), and the next round
reads the positions the target verified from the target's features, as EAGLE does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrt.backends.base import NEED_ARGMAX, NEED_LOGITS, PREFILL_CHUNK, Forward
from specrt.backends.batched import BatchedDecoder
from specrt.backends.rows import RowsDecoder
from specrt.errors import BundleError


class EagleDraft(RowsDecoder):
    """The head ``head`` drafting for ``target`` (whose graph computes the head's features):
    the `RowsDecoder` calls the round engine and the runner make of a draft."""

    windowed = False  # its slots are the target's positions: it reads a row whole
    catch_up_above = 8  # a round's verified tokens (K + 1 at most) in its first call

    def __init__(self, head: BatchedDecoder, target: BatchedDecoder) -> None:
        # Not RowsDecoder.__init__: the head's decoder holds the cache and the session.
        if not target._feature_width or target._feature_width != head._hidden_width:
            raise BundleError(
                "the bundle's EAGLE head needs the target's features, which its target graph "
                "does not compute (or not at the head's width); re-export the bundle with the head"
            )
        self.head, self.target = head, target
        self.role = head.role
        self.vocab_size = head.vocab_size
        self.max_batch = min(head.max_batch, target.max_batch)
        self.max_positions = head.max_positions
        self.model_max_positions = head.model_max_positions
        self.spec = head.spec
        # Leading slots of each row read from the target's features (the rest: this round's).
        self._verified = np.zeros(head.max_batch, dtype=np.int64)
        # Each row's hidden state at its newest slot: the features of the slot after it.
        self._newest = np.zeros((head.max_batch, head._hidden_width), dtype=np.float32)

    # What the runner reads and sets -----------------------------------------------------------
    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each row the head has read: its slots, and the row's first token."""
        return self.head.lengths + 1

    @property
    def run_time_s(self) -> float:
        return self.head.run_time_s

    @property
    def resizes(self) -> int:
        return self.head.resizes

    @property
    def capacity(self) -> int:
        return self.head.capacity

    @property
    def cache_bytes_per_row(self) -> int:
        return self.head.cache_bytes_per_row

    @property
    def cache_bytes(self) -> int:
        return self.head.cache_bytes

    def set_length(self, row: int, length: int) -> None:
        """Keep the row's first ``length`` tokens, and of its slots only those read from the
        target's features."""
        slots = min(max(0, length - 1), int(self._verified[row]))
        self.head.set_length(row, slots)
        self._verified[row] = min(self._verified[row], slots)

    def rollback(self, length: int) -> None:
        self.set_length(0, length)

    def reset(self) -> None:
        self.head.reset()
        self._verified[:] = 0

    def shrink(self, headroom: int = 0, keep: int = 0) -> None:
        self.head.shrink(headroom, keep)

    def reserve(self) -> None:
        self.head.reserve()

    def clear_stale(self) -> None:
        self.head.clear_stale()

    def move_row(self, source: int, dest: int) -> None:
        self.copy_row(source, dest)
        self.set_length(source, 0)

    def copy_row(self, source: int, dest: int, length: int | None = None) -> None:
        """Copy ``source``'s slots into ``dest``, or those of its first ``length`` tokens it
        read from the target's features (a beginning the rows share: a slot reads the token
        after its position too); the next catch-up reads the rest."""
        slots = self._verified[source] if length is None else max(0, length - 1)
        slots = min(int(slots), int(self._verified[source]))
        self.head.copy_row(source, dest, slots if length is not None else None)
        self._verified[dest] = slots
        self._newest[dest] = self._newest[source]

    # Feeding tokens ----------------------------------------------------------------------------
    def prefill_rows(self, start: int, prompts: list[Sequence[int]]) -> None:
        """Feed each row the tokens of ``prompts[i]`` whose slots the target has features for
        (the rest wait for the round that catches the head up), `PREFILL_CHUNK` at a time."""
        lengths = self.lengths[start : start + len(prompts)].tolist()
        targets = self.target.lengths[start : start + len(prompts)].tolist()
        # a row's token t (t >= 1) goes in slot t - 1: the target must hold that position
        ready = [
            list(p[: max(0, held + 1 - length)])
            for p, length, held in zip(prompts, lengths, targets)
        ]
        while any(ready):
            chunk = [tokens[:PREFILL_CHUNK] for tokens in ready]
            self._feed(start, chunk, 1, NEED_ARGMAX)
            ready = [tokens[PREFILL_CHUNK:] for tokens in ready]

    def forward_rows(
        self,
        tokens: np.ndarray,
        keep_last: int = 0,
        fed: np.ndarray | None = None,
        start: int = 0,
        need: str = NEED_LOGITS,
    ) -> Forward:
        n, count = tokens.shape
        if count == 1 and fed is None:  # a chain step, or a first call of one token a row
            return self._step(start, tokens, need)
        counts = [count] * n if fed is None else np.broadcast_to(fed, n).tolist()
        rows = [tokens[i, :c].tolist() for i, c in enumerate(counts)]
        return self._feed(start, rows, keep_last or count, need, width=count)

    def forward(self, tokens: Sequence[int], keep_last: int = 0, need: str = NEED_LOGITS):
        out = self._feed(0, [list(tokens)], keep_last or len(tokens), need)
        probabilities = None if out.probabilities is None else out.probabilities[0]
        return Forward(out.logits[0], probabilities)

    def _step(self, start: int, tokens: np.ndarray, need: str) -> Forward:
        """`_feed` of one token a row, without a loop over the rows (a round's chained steps
        are most of a head's calls)."""
        n = len(tokens)
        if n == 1:  # plain Python: numpy's per-call cost, cold after a model call, is more
            slot = int(self.head.lengths[start])
            if slot < int(self.target.lengths[start]):
                hidden = self.target.features[start, slot]
                self._verified[start] += slot == self._verified[start]
            else:
                hidden = self._newest[start]
            out = self.head._call(start, 1, tokens, 1, 1, need, hidden=hidden)
            self._newest[start] = out.hidden[0, 0]
            return out
        rows = np.arange(start, start + n)
        slots = self.head.lengths[start : start + n]
        held = slots < self.target.lengths[start : start + n]  # the target's features there
        at = np.minimum(slots, self.target.features.shape[1] - 1)
        hidden = np.where(held[:, None], self.target.features[rows, at], self._newest[rows])
        grown = held & (slots == self._verified[rows])
        self._verified[rows[grown]] += 1
        out = self.head._call(start, n, tokens, 1, 1, need, hidden=hidden[:, None, :])
        self._newest[rows] = out.hidden[:, 0]
        return out

    def _feed(
        self,
        start: int,
        rows: list[list[int]],
        keep_last: int,
        need: str,
        width: int | None = None,
    ) -> Forward:
        """One head call: row ``start + i`` reads ``rows[i]`` in its next slots, each with
        the features of its slot; ``[n, keep_last]`` of the last ``width`` columns kept."""
        n = len(rows)
        width = width or max(1, max(map(len, rows)))
        slots = self.head.lengths[start : start + n].tolist()
        held = self.target.lengths[start : start + n].tolist()
        ids = np.zeros((n, width), dtype=np.int64)
        hidden = np.zeros((n, width, self._newest.shape[1]), dtype=np.float32)
        features = self.target.features
        for i, (tokens, slot, known) in enumerate(zip(rows, slots, held)):
            row = start + i
            ids[i, : len(tokens)] = tokens
            verified = min(len(tokens), max(0, known - slot))  # slots the target holds
            hidden[i, :verified] = features[row, slot : slot + verified]
            if verified < len(tokens):  # chaining: the head's own state of the slot before
                if verified or len(tokens) > 1:
                    raise RuntimeError("an EAGLE head chains one token at a time")
                hidden[i, 0] = self._newest[row]
            if verified and slot == self._verified[row]:
                self._verified[row] = slot + verified
        fed = np.array([len(tokens) for tokens in rows], dtype=np.int64)
        out = self.head._call(start, n, ids, keep_last, fed, need, hidden=hidden)
        last = fed - 1 - (width - keep_last)  # each row's newest real column, among those kept
        for i in range(n):
            if fed[i] and last[i] >= 0:
                self._newest[start + i] = out.hidden[i, last[i]]
        return out

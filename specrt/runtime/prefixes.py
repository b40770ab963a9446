"""Prompts that begin alike: which of the rows admitted together read their whole prompt, and
which copy its beginning from a row whose target cache holds it (a running row's, one read just
before, or a finished row's kept in a free slot: `KeptRows`), so that a shared system prompt or
preamble, or the conversation a chat's next turn repeats, is read once (`BatchRunner._admit`)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from specrt.backends import RowsDecoder
from specrt.runtime.requests import Row

# Prompt tokens a new row must share with another's for the target to copy them rather than
# read them (fewer: a beginning of sequence, a chat template's first tokens, saves little).
MIN_SHARED_PREFIX = 16

Source = tuple[int, int]  # (slot, positions): where a row copies its prompt's beginning from
_KEEPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a cache -> its `KeptRows`


def arrange(
    rows: list[Row],
    running: list[Row],
    lengths: np.ndarray,
    kept: list[tuple[int, list[int]]] = (),
) -> tuple[list[Row], list[Source | None]]:
    """New ``rows`` in the order of their slots after the ``running`` ones (whose target cache
    holds ``lengths[slot]`` positions): first those that read their whole prompt, then those
    whose prompt begins as a running row's tokens, a ``kept`` finished row's (slot, the tokens
    its cache holds) or a prompt read before it (`MIN_SHARED_PREFIX` tokens or more in
    common). For each, where it copies that beginning from, or None. A prompt met again stays
    beside the first (`round.first_tokens`)."""
    start = len(running)
    held = [  # (slot, tokens, positions of them its cache holds)
        (slot, row.tokens, min(len(row.tokens), int(lengths[slot])))
        for slot, row in enumerate(running)
    ]
    held += [(slot, tokens, len(tokens)) for slot, tokens in kept]
    readers: list[Row] = []
    copiers: list[tuple[Row, Source]] = []
    placed: dict[tuple[int, ...], Source | None] = {}  # a prompt -> its source
    for row in rows:
        if row.request.config.prompt_logprobs is not None:  # its prompt's logits: read whole
            readers.append(row)
            continue
        prompt = tuple(row.tokens)
        if prompt not in placed:
            found = [(_shared(row.tokens, tokens, most), slot) for slot, tokens, most in held]
            shared, slot = max(found, default=(0, -1))
            placed[prompt] = (slot, shared) if shared >= MIN_SHARED_PREFIX else None
            if placed[prompt] is None:  # read whole: later prompts may begin as it does
                held.append((start + len(readers), row.tokens, len(row.tokens)))
        if placed[prompt] is None:
            readers.append(row)
        else:
            copiers.append((row, placed[prompt]))
    sources = [None] * len(readers) + [source for _, source in copiers]
    return readers + [row for row, _ in copiers], sources


def firsts_of(prompts: Sequence[Sequence[int] | None]) -> list[int]:
    """For each prompt, the index of the first equal one (None: a row of its own)."""
    seen: dict[tuple[int, ...], int] = {}
    return [
        i if prompt is None else seen.setdefault(tuple(prompt), i)
        for i, prompt in enumerate(prompts)
    ]


def _shared(prompt: list[int], tokens: list[int], held: int) -> int:
    """How many of ``prompt``'s first tokens are ``tokens``' first ``held``, leaving at least
    its last token to read (the pass that gives its first new token)."""
    most = min(held, len(prompt) - 1, len(tokens))
    for i in range(most):
        if prompt[i] != tokens[i]:
            return i
    return max(0, most)


class KeptRows:
    """Finished rows whose target cache stays in a free slot for a later prompt that begins as
    one of them did: a service's requests with one system prompt arriving one after another,
    a chat's next turn repeating the conversation so far. A finished row is copied into the
    highest free slot (new rows take the lowest), the least recently used kept row giving its
    slot up where none is free; in the last slot it stays where it is. The cache says what
    still holds (``kept_positions``): it moves a kept row's positions with the rows' own when
    it resizes, and gives up a slot a call or a copy writes (a new row there, a caller using
    row 0 directly), a cleared one (after a failed row) and what a smaller capacity cuts.
    One for a cache (`of`), whoever runs rows on it: a generator's calls one after another
    share it. Only the target's cache: a draft model reads a window, and a head reads every
    position itself."""

    def __init__(self, target: RowsDecoder) -> None:
        self._target = weakref.ref(target)  # (a strong one would keep it in `_KEEPERS` for good)
        self.on = getattr(target, "copies_rows", True)
        self.slots: dict[int, list[int]] = {}  # slot -> the tokens its cache holds (oldest first)

    @property
    def target(self) -> RowsDecoder:
        return self._target()

    @classmethod
    def of(cls, target: RowsDecoder) -> KeptRows:
        """``target``'s: two keepers of one cache would each take the other's slots for theirs."""
        kept = _KEEPERS.get(target)
        if kept is None:
            kept = _KEEPERS[target] = cls(target)
        return kept

    def keep(self, slot: int, tokens: list[int], edge: int) -> None:
        """The row in ``slot`` (its cache holding ``tokens``) leaves; ``edge`` is the last
        running slot, whose row then moves into ``slot``."""
        if not self.on or len(tokens) < MIN_SHARED_PREFIX:
            return
        self._sync()
        for other, held in list(self.slots.items()):
            if tokens[: len(held)] == held:  # the new row holds all it does, and more
                self._drop(other)
            elif held[: len(tokens)] == tokens:
                return
        free = [s for s in range(self.target.max_batch - 1, edge, -1) if s not in self.slots]
        if free:
            dest = free[0]
        elif self.slots:  # the least recently used one gives its slot up
            dest = next(iter(self.slots))
            self._drop(dest)
        elif slot == edge:  # the last slot (one row: the only one)
            dest = slot
        else:
            return
        if dest != slot:
            self.target.copy_row(slot, dest, len(tokens))
            self.target.set_length(dest, 0)  # a free slot: calls and shrinking leave it out
        self.slots[dest] = tokens
        self.target.kept_positions[dest] = len(tokens)

    def sources(self, start: int, count: int) -> list[tuple[int, list[int]]]:
        """The kept rows ``count`` new rows in slots ``start ..`` may copy from: those they do
        not take, and the first slot's own for a row admitted alone (it reads the rest there).
        The slots they take are given up."""
        self._sync()
        usable = [
            (slot, tokens)
            for slot, tokens in self.slots.items()
            if slot >= start + count or (count == 1 and slot == start)
        ]
        for slot in range(start, start + count):
            self._drop(slot)
        return usable

    def used(self, slot: int) -> None:
        """A new row copied from kept ``slot``: it is the most recently used."""
        if slot in self.slots:
            self.slots[slot] = self.slots.pop(slot)

    def clear(self) -> None:
        for slot in list(self.slots):
            self._drop(slot)

    @property
    def longest(self) -> int:
        self._sync()
        return max(map(len, self.slots.values()), default=0)

    def _sync(self) -> None:
        """Keep what the cache still holds of each kept row."""
        held = self.target.kept_positions if self.slots else {}
        for slot, tokens in list(self.slots.items()):
            positions = held.get(slot, 0)
            if positions < MIN_SHARED_PREFIX:
                self._drop(slot)
            elif positions < len(tokens):
                self.slots[slot] = tokens[:positions]

    def _drop(self, slot: int) -> None:
        if self.slots.pop(slot, None) is not None:
            self.target.kept_positions.pop(slot, None)

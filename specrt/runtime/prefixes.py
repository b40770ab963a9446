"""Prompts that begin alike: which of the rows admitted together read their whole prompt, and
which copy its beginning from a row whose target cache holds it (a running row's, or one read
just before), so that a shared system prompt or preamble is read once (`BatchRunner._admit`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrt.runtime.requests import Row

# Prompt tokens a new row must share with another's for the target to copy them rather than
# read them (fewer: a beginning of sequence, a chat template's first tokens, saves little).
MIN_SHARED_PREFIX = 16

Source = tuple[int, int]  # (slot, positions): where a row copies its prompt's beginning from


def arrange(
    rows: list[Row], running: list[Row], lengths: np.ndarray
) -> tuple[list[Row], list[Source | None]]:
    """New ``rows`` in the order of their slots after the ``running`` ones (whose target cache
    holds ``lengths[slot]`` positions): first those that read their whole prompt, then those
    whose prompt begins as a running row's tokens or as a prompt read before it
    (`MIN_SHARED_PREFIX` tokens or more in common). For each, where it copies that beginning
    from, or None. A prompt met again stays beside the first (`round.first_tokens`)."""
    start = len(running)
    held = [  # (slot, tokens, positions of them its cache holds)
        (slot, row.tokens, min(len(row.tokens), int(lengths[slot])))
        for slot, row in enumerate(running)
    ]
    readers: list[Row] = []
    copiers: list[tuple[Row, Source]] = []
    placed: dict[tuple[int, ...], Source | None] = {}  # a prompt -> its source
    for row in rows:
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

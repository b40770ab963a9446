"""Drafters behind one small interface, so a model drafter and e.g. a prompt-lookup drafter are
interchangeable in the loop (as transformers' candidate generators are).

``prefill(tokens)`` shows the drafter a prompt; ``propose(tokens, k, ...)`` returns up to k draft
tokens continuing ``tokens`` and, when sampling, the distributions they were drawn from (after
the same warp the target gets); ``rollback(n)`` says that only ``tokens[:n]`` stand: the drafter
keeps whatever state is still valid; ``observe(round)`` tells it how the round went (its
verification time None where the pass also fed the end of a prompt).

`ModelDrafter` runs a small model; `LookupDrafter` matches the row against its own text (and a
`SuffixCache` of earlier requests); `specrt.runtime.hybrid.HybridDrafter` picks between them
each round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specrt.backends import Decoder
from specrt.runtime.config import SamplingParams
from specrt.runtime.lookup import NgramIndex, Proposal, SuffixCache, find_match
from specrt.runtime.sampling import (
    LOOP_DTYPE,
    Draws,
    check_probabilities,
    draw,
    greedy_tokens,
    rows_needed,
    top_probability,
    warp,
)
from specrt.runtime.schedules import KeepGoing


@dataclass
class Draft:
    """Draft tokens and, when sampling, ``probabilities [len(tokens), V]``: the distribution
    each was drawn from (None when greedy, or for point masses: tokens chosen without a
    distribution). ``source``: the proposer ("model", "lookup", "suffix"). Valid until the
    drafter's next call."""

    tokens: list[int]
    probabilities: np.ndarray | None
    source: str = "model"
    catch_up_s: float = 0.0  # spent feeding the model what it missed: not this round's cost


class Drafter(Protocol):
    max_positions: int  # the longest sequence the drafter can continue
    run_time_s: float  # total time spent running models, for overhead accounting

    def reset(self) -> None: ...

    def prefill(self, tokens: Sequence[int]) -> None: ...

    def propose(
        self,
        tokens: list[int],
        k: int,
        sampling: SamplingParams,
        rng: Draws,
        keep_drafting: KeepGoing | None = None,
        limit: int | None = None,
    ) -> Draft: ...

    def rollback(self, valid_length: int) -> None: ...

    def observe(
        self,
        source: str,
        drafted: int,
        accepted: int,
        draft_time_s: float,
        verify_time_s: float | None,
    ) -> None: ...


class ModelDrafter:
    """K autoregressive steps of a small model, fed every token it has not yet seen."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.max_positions = decoder.max_positions
        self._q: np.ndarray | None = None
        # The row's first ``offset`` tokens are not in the model's cache: it reads the row from
        # there (a hybrid's model skips ahead to a window of a long context).
        self.offset = 0

    @property
    def run_time_s(self) -> float:
        return self.decoder.run_time_s

    def reset(self) -> None:
        self.decoder.reset()
        self.offset = 0

    def prefill(self, tokens: Sequence[int]) -> None:
        self.decoder.prefill(tokens)

    def rollback(self, valid_length: int) -> None:
        self.decoder.rollback(max(0, valid_length - self.offset))

    def catch_up(self, tokens: list[int], window: int | None = None) -> None:
        """Feed the model what it has not seen of ``tokens`` but the newest token; where that
        is more than ``window``, only the last ``window`` of them (the model starts over
        there: a proposer's context, the output stays the target's)."""
        missed = tokens[self.offset + self.decoder.length : -1]
        if window is not None and len(missed) > window:
            self.decoder.rollback(0)
            self.offset = len(tokens) - 1 - window
            missed = tokens[self.offset : -1]
        if len(missed) > 1:
            self.decoder.prefill(missed)

    def observe(
        self,
        source: str,
        drafted: int,
        accepted: int,
        draft_time_s: float,
        verify_time_s: float | None,
    ) -> None:
        pass  # the draft-length schedule learns from model rounds

    def propose(
        self,
        tokens: list[int],
        k: int,
        sampling: SamplingParams,
        rng: Draws,
        keep_drafting: KeepGoing | None = None,
        limit: int | None = None,
    ) -> Draft:
        """Up to ``k`` tokens; ``keep_drafting`` may stop earlier, judging by the draft's
        confidence in each token it drafted (its probability of that token: the top one when
        greedy). (``limit``, the most that
        fit this round, is for proposers that choose their own length.)"""
        drafted: list[int] = []
        q = None if sampling.greedy else self._q_buffer(k)
        if k:  # behind (a row admitted while the model did not draft)
            self.catch_up(tokens)
        pending = tokens[self.offset + self.decoder.length :]
        need = rows_needed(sampling)
        while len(drafted) < k:
            out = self.decoder.forward(pending, keep_last=1, need=need)
            logits = None if out.logits is None else out.logits[-1]
            probabilities = out.probabilities
            if q is None:
                [token] = greedy_tokens(out, "draft")
                if keep_drafting is None:
                    confidence = 0.0
                elif out.max_probability is not None:  # computed where the model ran
                    confidence = float(out.max_probability[-1])
                elif probabilities is not None:
                    confidence = float(probabilities[-1, token])
                else:
                    confidence = top_probability(logits, token)
            else:
                row = q[len(drafted)]
                if probabilities is not None and sampling.identity_warp:
                    row[:] = probabilities[-1]
                    check_probabilities(row, logits, "draft")
                else:
                    s = sampling
                    row[:] = warp(logits, s.temperature, s.top_k, s.top_p, "draft", LOOP_DTYPE)
                token = draw(row, rng, len(tokens) + len(drafted))
                # the probability of the token drawn, as greedy's is its argmax's
                confidence = float(row[token]) if keep_drafting else 0.0
            drafted.append(token)
            pending = [token]
            if keep_drafting is not None and not keep_drafting(len(drafted), confidence):
                break
        return Draft(drafted, None if q is None else q[: len(drafted)])

    def _q_buffer(self, k: int) -> np.ndarray:
        """Rows for the draft distributions, reused across rounds: a fresh [K, vocab] array each
        round is large enough to come from mmap, and its page faults cost more than a draft
        step."""
        if self._q is None or len(self._q) < k:
            self._q = np.empty((k, self.decoder.vocab_size), dtype=LOOP_DTYPE)
        return self._q[:k]


class LookupDrafter:
    """Point-mass proposals found by matching: the row's own prompt and output (prompt lookup)
    and, where the row's text has no match, a `SuffixCache` of earlier requests when given (the
    row's own matches were accepted far more often on held-out text: 0.7 against 0.2). No model
    runs: ``k`` tokens cost only their verification."""

    max_positions = 1 << 62  # no model of its own: any length can be continued
    run_time_s = 0.0

    def __init__(self, index: NgramIndex | None = None, suffix: SuffixCache | None = None) -> None:
        self.index = index if index is not None else NgramIndex()
        self.suffix = suffix

    def reset(self) -> None:
        self.index.reset()

    def prefill(self, tokens: Sequence[int]) -> None:
        pass  # indexed at the first proposal

    def rollback(self, valid_length: int) -> None:
        pass  # the index holds accepted tokens only

    def observe(
        self,
        source: str,
        drafted: int,
        accepted: int,
        draft_time_s: float,
        verify_time_s: float | None,
    ) -> None:
        pass

    def find(self, tokens: list[int], k: int) -> Proposal:
        """The row's own match, else the suffix cache's (``NO_PROPOSAL``: none)."""
        return find_match(self.index, self.suffix, tokens, k)

    def propose(
        self,
        tokens: list[int],
        k: int,
        sampling: SamplingParams,
        rng: Draws,
        keep_drafting: KeepGoing | None = None,
        limit: int | None = None,
    ) -> Draft:
        found = self.find(tokens, k)
        return Draft(found.tokens, None, found.source or "lookup")

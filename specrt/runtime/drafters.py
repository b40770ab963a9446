"""Drafters behind one small interface, so a model drafter and e.g. a prompt-lookup drafter are
interchangeable in the generator.

``propose(tokens, k, ...)`` returns k draft tokens continuing ``tokens`` and, when sampling, the
distributions ``q`` they were drawn from (after the same warp the target gets). ``rollback(n)``
tells the drafter that only ``tokens[:n]`` stand; it keeps whatever state is still valid.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from specrt.runtime.config import GenerationConfig
from specrt.runtime.decoder import Decoder
from specrt.runtime.draft_length import KeepGoing
from specrt.runtime.sampling import (
    LOOP_DTYPE,
    check_probabilities,
    greedy_token,
    sample,
    top_probability,
    warp,
)


class Drafter(Protocol):
    max_positions: int

    def reset(self) -> None: ...

    def propose(
        self,
        tokens: list[int],
        k: int,
        config: GenerationConfig,
        rng: np.random.Generator,
        keep_going: KeepGoing | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]: ...

    def rollback(self, valid_length: int) -> None: ...


class ModelDrafter:
    """K autoregressive steps of a small model, fed every token it has not yet seen."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.max_positions = decoder.max_positions
        self._q: np.ndarray | None = None

    def reset(self) -> None:
        self.decoder.reset()

    def prefill(self, tokens: list[int]) -> None:
        self.decoder.prefill(tokens)

    def propose(
        self,
        tokens: list[int],
        k: int,
        config: GenerationConfig,
        rng: np.random.Generator,
        keep_going: KeepGoing | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Up to ``k`` tokens; ``keep_going`` may stop earlier, judging by the draft's confidence
        (its top probability) in each token it drafted. The returned ``q`` is valid until the
        next call."""
        drafted = np.empty(k, dtype=np.int64)
        q = None if config.greedy else self._q_buffer(k)
        pending = tokens[self.decoder.length :]
        decoder, count = self.decoder, 0
        while count < k:
            logits = decoder.forward(pending)[-1]  # only the last position matters
            probabilities = decoder.probabilities
            if q is None:
                drafted[count] = best = greedy_token(logits, "draft")
                if keep_going is None:
                    confidence = 0.0
                elif probabilities is not None:
                    confidence = float(probabilities[-1, best])
                else:
                    confidence = top_probability(logits, best)
            else:
                if probabilities is not None and config.unwarped:
                    q[count] = probabilities[-1]
                    check_probabilities(q[count], logits, "draft")
                else:
                    q[count] = warp(
                        logits, config.temperature, config.top_k, config.top_p, "draft", LOOP_DTYPE
                    )
                drafted[count] = sample(q[count], rng)
                confidence = float(q[count].max()) if keep_going else 0.0
            pending = [int(drafted[count])]
            count += 1
            if keep_going is not None and not keep_going(count, confidence):
                break
        return drafted[:count], None if q is None else q[:count]

    def rollback(self, valid_length: int) -> None:
        self.decoder.rollback(valid_length)

    def _q_buffer(self, k: int) -> np.ndarray:
        """Rows for the draft distributions, reused across rounds: a fresh [K, vocab] array each
        round is large enough to come from mmap, and its page faults cost more than a draft
        step."""
        if self._q is None or len(self._q) < k:
            self._q = np.empty((k, self.decoder.vocab_size), dtype=LOOP_DTYPE)
        return self._q[:k]

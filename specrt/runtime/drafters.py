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
from specrt.runtime.sampling import check_finite, check_greedy_finite, sample, warp


class Drafter(Protocol):
    max_positions: int

    def reset(self) -> None: ...

    def propose(
        self, tokens: list[int], k: int, config: GenerationConfig, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray | None]: ...

    def rollback(self, valid_length: int) -> None: ...


class ModelDrafter:
    """K autoregressive steps of a small model, fed every token it has not yet seen."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.max_positions = decoder.max_positions

    def reset(self) -> None:
        self.decoder.reset()

    def prefill(self, tokens: list[int]) -> None:
        if tokens:
            self.decoder.forward(tokens)

    def propose(
        self, tokens: list[int], k: int, config: GenerationConfig, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray | None]:
        drafted = np.empty(k, dtype=np.int64)
        q = None if config.greedy else np.empty((k, self.decoder.vocab_size))
        pending = tokens[self.decoder.length :]
        for i in range(k):
            logits = self.decoder.forward(pending)[-1]
            if q is None:
                check_greedy_finite(logits, "draft")
                drafted[i] = logits.argmax()
            else:
                check_finite(logits, "draft")
                q[i] = warp(logits, config.temperature, config.top_k, config.top_p)
                drafted[i] = sample(q[i], rng)
            pending = [int(drafted[i])]
        return drafted, q

    def rollback(self, valid_length: int) -> None:
        self.decoder.rollback(valid_length)

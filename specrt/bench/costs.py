"""Per-call cost of a decoder: what the speedup formula's c and the verify cost are made of."""

from __future__ import annotations

import statistics
import time

import numpy as np

from specrt.backends import NEED_ARGMAX, Decoder


def step_seconds(
    decoder: Decoder,
    context: int = 256,
    tokens: int = 1,
    repeats: int = 200,
    need: str = NEED_ARGMAX,
) -> float:
    """Median wall time of one call feeding ``tokens`` new tokens on a warm cache of ``context``,
    bringing back what ``need`` names for each of them: by default each row's argmax, what a
    greedy round reads (a vocabulary of logits per row would time the copy, not the step)."""
    rng = np.random.default_rng(0)
    context = min(context, decoder.max_positions - tokens - 1)
    history = rng.integers(0, decoder.vocab_size, context).tolist()
    step = rng.integers(0, decoder.vocab_size, tokens).tolist()
    decoder.reset()
    decoder.prefill(history)
    times = []
    for _ in range(repeats + 3):
        started = time.perf_counter()
        decoder.forward(step, need=need)
        times.append(time.perf_counter() - started)
        decoder.rollback(context)
    decoder.reset()
    return statistics.median(times[3:])

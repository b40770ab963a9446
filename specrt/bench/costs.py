"""Per-call cost of a decoder: what the speedup formula's c and the verify cost are made of."""

from __future__ import annotations

import statistics
import time

import numpy as np

from specrt.backends import Decoder


def step_seconds(
    decoder: Decoder, context: int = 256, tokens: int = 1, repeats: int = 200
) -> float:
    """Median wall time of one call feeding ``tokens`` new tokens on a warm cache of ``context``."""
    rng = np.random.default_rng(0)
    context = min(context, decoder.max_positions - tokens - 1)
    history = rng.integers(0, decoder.vocab_size, context).tolist()
    step = rng.integers(0, decoder.vocab_size, tokens).tolist()
    decoder.reset()
    decoder.forward(history)
    times = []
    for _ in range(repeats + 3):
        started = time.perf_counter()
        decoder.forward(step)
        times.append(time.perf_counter() - started)
        decoder.rollback(context)
    decoder.reset()
    return statistics.median(times[3:])

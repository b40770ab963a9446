"""A chi-square goodness-of-fit test shared by the statistical tests."""

from __future__ import annotations

import numpy as np
from scipy.stats import chisquare


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """p-value of ``counts`` being a sample of ``probs``. Cells with an expected count below
    ``min_expected`` are pooled into one, so the chi-square approximation holds. A count in a
    cell of probability 0 is impossible under ``probs``: p-value 0."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    if np.any(counts[probs == 0] > 0):
        return 0.0
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = probs * counts.sum()
    small = expected < min_expected
    observed_cells = list(counts[~small]) + ([counts[small].sum()] if small.any() else [])
    expected_cells = list(expected[~small]) + ([expected[small].sum()] if small.any() else [])
    if len(observed_cells) < 2:
        return 1.0
    return float(chisquare(observed_cells, expected_cells).pvalue)

"""Chi-square goodness of fit in the standard library's arithmetic: the runtime depends on numpy,
onnxruntime and tokenizers only, and scipy is a test dependency (the tests check these
functions against scipy's)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MIN_EXPECTED = 5.0  # the usual rule: below 5 expected, a cell's term is not near chi-square
_EPSILON = 1e-15
_MAX_TERMS = 100_000  # both expansions converge in O(sqrt(df)) terms; a guard, never reached
_TINY = 1e-300


def chi2_sf(x: float, df: float) -> float:
    """P(X >= x) for X chi-square with ``df`` degrees of freedom: the regularised upper
    incomplete gamma function Q(df / 2, x / 2)."""
    if not df > 0:
        raise ValueError(f"df={df!r}: degrees of freedom must be > 0")
    if math.isnan(x):
        raise ValueError("x is NaN")
    if x <= 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    a, z = df / 2.0, x / 2.0
    if z < a + 1.0:  # the series converges fast here; the continued fraction beyond
        return max(0.0, 1.0 - _lower_series(a, z))
    return min(1.0, _upper_continued_fraction(a, z))


def _prefactor(a: float, z: float) -> float:
    """z^a e^-z / Gamma(a), in logarithms (each factor alone overflows for large a)."""
    return math.exp(a * math.log(z) - z - math.lgamma(a))


def _lower_series(a: float, z: float) -> float:
    """P(a, z) = z^a e^-z / Gamma(a) * sum_n z^n / (a (a+1) ... (a+n))."""
    term = total = 1.0 / a
    denominator = a
    for _ in range(_MAX_TERMS):
        denominator += 1.0
        term *= z / denominator
        total += term
        if abs(term) < abs(total) * _EPSILON:
            break
    return total * _prefactor(a, z)


def _upper_continued_fraction(a: float, z: float) -> float:
    """Q(a, z) by its continued fraction, evaluated by the modified Lentz method."""
    b = z + 1.0 - a
    c = 1.0 / _TINY
    d = 1.0 / b
    h = d
    for i in range(1, _MAX_TERMS):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = _TINY if abs(d) < _TINY else d
        c = b + an / c
        c = _TINY if abs(c) < _TINY else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPSILON:
            break
    return _prefactor(a, z) * h


@dataclass(frozen=True)
class Fit:
    """A goodness-of-fit test's outcome: ``pvalue``, the statistic and the cells it summed
    over after pooling (``impossible``: a count fell in a cell of expected count 0)."""

    pvalue: float
    statistic: float
    cells: int
    impossible: bool = False


def goodness_of_fit(
    observed: np.ndarray, expected: np.ndarray, min_expected: float = MIN_EXPECTED
) -> Fit:
    """Pearson's chi-square test of ``observed`` counts against ``expected`` counts (the same
    total). Cells expected below ``min_expected`` are pooled into one, and that one, if still
    below it, into the smallest other cell, so that every term is near chi-square. A count
    where 0 is expected cannot happen under the law: p-value 0."""
    observed = np.asarray(observed, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if np.any(observed[expected <= 0] > 0):
        return Fit(0.0, math.inf, 0, impossible=True)
    small = expected < min_expected
    cells_observed, cells_expected = list(observed[~small]), list(expected[~small])
    pooled_observed, pooled_expected = float(observed[small].sum()), float(expected[small].sum())
    if pooled_expected > 0 or pooled_observed > 0:
        if pooled_expected < min_expected and cells_expected:
            smallest = int(np.argmin(cells_expected))
            cells_observed[smallest] += pooled_observed
            cells_expected[smallest] += pooled_expected
        else:
            cells_observed.append(pooled_observed)
            cells_expected.append(pooled_expected)
    if len(cells_expected) < 2:  # one cell always fits: nothing to test
        return Fit(1.0, 0.0, len(cells_expected))
    o, e = np.array(cells_observed), np.array(cells_expected)
    if np.any(e <= 0):  # the pooled cell of a law with no mass there, and counts in it
        return Fit(0.0, math.inf, len(e), impossible=True)
    statistic = float(((o - e) ** 2 / e).sum())
    return Fit(chi2_sf(statistic, len(e) - 1), statistic, len(e))

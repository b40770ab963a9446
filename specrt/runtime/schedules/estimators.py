"""What the schedules and the hybrid proposer estimate with: a moving average, a decayed line fit
(verification time against positions fed), recent round times per batch size, and when to check
a choice again."""

from __future__ import annotations

import statistics
from collections import deque

from specrt.runtime.schedules.constants import (
    LOAD_EXPLORE_EVERY,
    LOAD_EXPLORE_MAX_SPACING,
    LOAD_WINDOW,
)


def moving_average(old: float | None, new: float, weight: float) -> float:
    """``new`` moved into ``old`` by ``weight`` (``new`` itself when there is no ``old``)."""
    return new if old is None else old + weight * (new - old)


class LineFit:
    """Least-squares line y = a + b x over exponentially decayed observations."""

    def __init__(self, smoothing: float) -> None:
        self.smoothing = smoothing
        self._sums = [0.0] * 5  # n, sum x, sum x^2, sum y, sum xy
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, x: float, y: float) -> None:
        keep = 1 - self.smoothing
        self._sums = [keep * a + b for a, b in zip(self._sums, (1.0, x, x * x, y, x * y))]
        self._count += 1

    @property
    def slope(self) -> float | None:
        """None until two different x have been seen."""
        n, sx, sxx, sy, sxy = self._sums
        spread = n * sxx - sx * sx
        if spread <= 1e-6 * n * n:
            return None
        return max(0.0, (n * sxy - sx * sy) / spread)

    def mean(self) -> tuple[float, float] | None:
        """The (x, y) centre of the observations (None before the first); the line passes
        through it."""
        n, sx, _, sy, _ = self._sums
        return (sx / n, sy / n) if n else None


class RoundTimes:
    """Recent times of one kind of round (`LoadSchedule._relative`), kept apart for each batch
    size: a job's tail (fewer rows) must not be priced from, nor evict, the full batch's many
    rounds."""

    def __init__(self) -> None:
        self.by_size: dict[int, deque[float]] = {}
        self._medians: dict[int, float] = {}  # asked for every round, changed by one size

    def add(self, rows: int, seconds: float) -> None:
        self.by_size.setdefault(rows, deque(maxlen=LOAD_WINDOW)).append(seconds)
        self._medians.pop(rows, None)

    def __len__(self) -> int:
        return sum(map(len, self.by_size.values()))

    def median(self, rows: int) -> float:
        if rows not in self._medians:
            self._medians[rows] = statistics.median(self.by_size[rows])
        return self._medians[rows]

    def predict(self, rows: int) -> float:
        """Seconds of a round of ``rows`` rows: the median of that size's rounds where measured,
        else a line through the medians of the nearest measured sizes on either side (the two
        nearest beyond the range; a constant while only one size is measured)."""
        if rows in self.by_size:
            return self.median(rows)
        sizes = sorted(self.by_size)
        if len(sizes) == 1:
            return self.median(sizes[0])
        below = [n for n in sizes if n < rows][-2:]
        above = [n for n in sizes if n > rows][:2]
        if below and above:
            low, high = below[-1], above[0]
        else:
            low, high = below or above
        t_low, t_high = self.median(low), self.median(high)
        slope = max((t_high - t_low) / (high - low), 0.0)
        return max(t_low + slope * (rows - low), 1e-6)


class CheckSpacing:
    """When to measure a neighbour of the best choice again: after `LOAD_EXPLORE_EVERY` rounds,
    then twice as long each time the best held since the last check (up to
    `LOAD_EXPLORE_MAX_SPACING` times that)."""

    def __init__(self) -> None:
        self.rounds, self.every, self.best = 0, LOAD_EXPLORE_EVERY, -1

    def tick(self) -> bool:
        """Count a round; whether a check is due."""
        self.rounds += 1
        return self.rounds >= self.every

    def restart(self, best: int) -> None:
        """A check of a neighbour of ``best`` starts now."""
        held = best == self.best
        longest = LOAD_EXPLORE_MAX_SPACING * LOAD_EXPLORE_EVERY
        self.every = min(longest, 2 * self.every) if held else LOAD_EXPLORE_EVERY
        self.rounds, self.best = 0, best

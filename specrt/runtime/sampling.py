"""Logits -> probabilities (temperature, top-k, top-p, min-p) and drawing a token.

The draft and the target go through the very same `warp`, so the rejection sampler compares
distributions of the same kind and the output follows the *warped* target distribution exactly.
Order of the filters follows transformers: temperature, then top-k, top-p and min-p.
"""

from __future__ import annotations

import math

import numpy as np

from specrt.backends import NEED_ARGMAX, NEED_LOGITS, NEED_PROBABILITIES, Forward
from specrt.errors import NumericalError
from specrt.runtime.config import GenerationConfig, SamplingParams

LOOP_DTYPE = np.float32  # what the generation loop warps and samples in (see `warp`)
_TINY = float(np.finfo(LOOP_DTYPE).tiny)


def argmax_tokens(logits: np.ndarray, model: str) -> list[int]:
    """The argmax of each row of ``logits [rows, V]``, refusing NaN/inf logits: argmax picks a
    NaN if a row has one and +inf if it has one, and a row whose pick is -inf is all -inf; a -inf
    elsewhere is harmless (it never wins). So only the picks are checked, in plain Python: right
    after an onnxruntime call every distinct numpy routine runs cold (its code and data were
    evicted by the model's weights), and fancy indexing plus ``isfinite`` cost several times a
    Python loop over the picks there (CHANGELOG.md, 2026-11-29)."""
    best = logits.argmax(axis=-1).tolist()
    for row, index in enumerate(best):
        if not math.isfinite(logits[row, index]):
            raise_not_finite(logits, model)
    return best


def rows_needed(sampling: SamplingParams) -> str:
    """What sampling reads of a pass: the argmax per row when greedy, the model's own softmax
    at temperature 1 without filters, else the logits to warp."""
    if sampling.greedy:
        return NEED_ARGMAX
    return NEED_PROBABILITIES if sampling.identity_warp else NEED_LOGITS


def greedy_tokens(out: Forward, model: str) -> list[int]:
    """Each row's best token from what a pass brought back: the backend's own argmax (refusing
    NaN/inf by the row's max logit), else the logits' argmax, else the softmax's."""
    if out.argmax is not None:
        for value in out.max_logit.tolist():
            if not math.isfinite(value):
                raise_not_finite(out.logits, model)
        return out.argmax
    if out.logits is not None:
        return argmax_tokens(out.logits, model)
    best = out.probabilities.argmax(axis=-1).tolist()
    for row in out.probabilities:
        check_probabilities(row, None, model)
    return best


def top_probability(logits: np.ndarray, best: int) -> float:
    """softmax(logits)[best] of a row whose argmax is ``best``."""
    shifted = logits - logits[best]
    return float(1.0 / np.exp(shifted, out=shifted).sum())


def check_probabilities(probabilities: np.ndarray, logits: np.ndarray | None, model: str) -> None:
    """Refuse a graph's softmax row made from NaN/inf logits. One entry tells: a NaN or +inf
    logit, or a row of -inf, makes the row's sum NaN and so every entry (the softmax divides
    by it)."""
    if not math.isfinite(probabilities[0]):
        raise_not_finite(logits, model)


def raise_not_finite(logits: np.ndarray | None, model: str) -> None:
    """``logits``: where they are on the host, to count the bad ones."""
    count = ""
    if logits is not None:
        count = f"{int(np.size(logits) - np.count_nonzero(np.isfinite(logits)))} "
    raise NumericalError(
        f"the {model} model produced {count}NaN/inf logit(s); the ONNX graph or its inputs are "
        "broken (an fp16 overflow is the usual cause: re-export in float32)"
    )


def warp(
    logits: np.ndarray,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    model: str | None = None,
    dtype: type = np.float64,
    min_p: float = 0.0,
) -> np.ndarray:
    """Turn logits ``[..., V]`` into sampling probabilities, rows summing to 1.

    ``temperature`` must be > 0 here; greedy decoding never needs probabilities. With ``model``
    (its role, for the message), NaN/inf logits raise `NumericalError` (checked on the row max:
    it is NaN or +inf if any logit is, and -inf only if all are). No setting makes NaN: logits
    are shifted by their max before they are scaled, so at any temperature the best token scores
    0 and the others at most that (a tiny temperature sends them to -inf, not to inf - inf), and
    top-p always keeps the most likely token; a huge temperature scales by at least the dtype's
    smallest normal number (1/T underflowing to 0 made -inf * 0 = NaN). The loop warps in
    float32, half the time of float64 over a vocabulary: probabilities within ~1e-7 of
    float64's, except where float32 rounding ties two logits at the top-k cut or moves a top-p
    boundary; the draft, the verifier and plain target steps all warp alike, so the output
    follows this float32 warp exactly. float64 is the default elsewhere.
    """
    top = logits.max(axis=-1, keepdims=True)
    if model is not None and not np.isfinite(top).all():
        raise_not_finite(logits, model)
    probs = np.subtract(logits, top, dtype=dtype)  # one new array
    scale = max(1.0 / temperature, float(np.finfo(dtype).tiny))
    if scale < 1e30:
        probs *= scale
    else:  # the other tokens' scores overflow to -inf, as they should
        with np.errstate(over="ignore"):
            probs *= min(scale, float(np.finfo(probs.dtype).max))
    vocab = probs.shape[-1]
    if 0 < top_k < vocab:
        kth = np.partition(probs, vocab - top_k, axis=-1)[..., vocab - top_k, None]
        probs[probs < kth] = -np.inf
    np.exp(probs, out=probs)
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        mass_before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < top_p  # smallest prefix whose mass reaches top_p
        keep_sorted[..., 0] = True  # a top_p below float precision still keeps the best token
        keep = np.empty_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    if min_p > 0.0:  # the best token always stays (min_p <= 1)
        probs[probs < min_p * probs.max(axis=-1, keepdims=True)] = 0.0
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def draw(weights: np.ndarray, rng: Draws, position: int) -> int:
    """A token from ``weights`` for the sequence's ``position``: by the row's keyed draws where
    it has them (a seeded row), else `sample`."""
    if isinstance(rng, KeyedDraws):
        return rng.token(weights, position)
    return sample(weights, rng)


class KeyedDraws:
    """A seeded row's sampling: its token at ``position`` is ``argmax_i w_i / E_i`` for the
    warped distribution ``w`` and noise ``E_i ~ Exp(1)`` that belongs to the position: the
    row's stream ``rng`` gives each position its ``[V]`` block in turn, from the first position
    sampled on. That is a draw from ``w`` (the exponential race: ``E_i / w_i`` is an
    exponential of rate ``w_i``, and the first to finish is ``i`` with probability ``w_i``).

    The draft draws its proposal at a position with the same noise, and the target keeps it
    only where it is the target's own draw there, so a seeded row's tokens are those of the
    target alone under that seed, whatever was drafted: whatever K, proposer, batch, neighbours
    or timing (the draft's acceptance, not the output, depends on them)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng
        self._noise: dict[int, np.ndarray] = {}  # positions not yet behind the row
        self._next: int | None = None  # the next position to draw noise for

    def token(self, weights: np.ndarray, position: int) -> int:
        return int(np.argmax(weights / self.noise(position, weights.shape[-1])))

    def noise(self, position: int, size: int) -> np.ndarray:
        """The noise of ``position`` (drawn, with that of any position before it not yet
        drawn, on first use); a position behind the row (`release`) has none."""
        if self._next is None:
            self._next = position
        if position < self._next and position not in self._noise:
            raise ValueError(f"position {position} is behind this row's draws")
        while self._next <= position:
            noise = self._rng.standard_exponential(size, dtype=LOOP_DTYPE)
            # A float32 exponential can round to 0: the smallest normal keeps w / E finite
            np.maximum(noise, _TINY, out=noise)
            self._noise[self._next] = noise
            self._next += 1
        return self._noise[position]

    def release(self, position: int) -> None:
        """The row's tokens before ``position`` stand: their noise is no longer needed."""
        for behind in [p for p in self._noise if p < position]:
            del self._noise[behind]


def sample(weights: np.ndarray, rng: np.random.Generator) -> int:
    """Draw index ``i`` with probability ``weights[i] / weights.sum()`` (non-negative weights,
    not all zero); a zero-weight index is never drawn.

    Inverse-CDF sampling in two levels: find the block of ~sqrt(V) entries the uniform draw falls
    in, then the entry within it. A cumulative sum over the whole vocabulary is a sequential pass
    (on a 152k vocabulary it costs more than a draft step); block sums vectorise, and the two
    cumulative sums left are sqrt(V) long."""
    size = weights.shape[-1]
    block, starts = _blocks(size)
    sums = np.add.reduceat(weights, starts)
    totals = np.cumsum(sums)
    u = rng.random() * float(totals[-1])
    b = int(np.searchsorted(totals, u, side="right"))  # totals[b-1] <= u < totals[b]
    if b >= len(totals):  # u rounded up to the total: the last block with mass
        b = int(np.flatnonzero(sums)[-1])
    low = b * block
    within = np.cumsum(weights[low : low + block])
    rest = u - (float(totals[b - 1]) if b else 0.0)
    i = int(np.searchsorted(within, rest, side="right"))
    if i >= len(within):  # the block's own sum came out a rounding below the total's step
        i = int(np.flatnonzero(weights[low : low + block])[-1])
    return low + i


_BLOCKS: dict[int, tuple[int, np.ndarray]] = {}


def _blocks(size: int) -> tuple[int, np.ndarray]:
    """Block length ~sqrt(size) and the blocks' start indices, per vocabulary size."""
    if size not in _BLOCKS:
        block = max(1, math.isqrt(size - 1) + 1) if size > 1 else 1
        _BLOCKS[size] = (block, np.arange(0, size, block))
    return _BLOCKS[size]


class WarpedRows:
    """``warp`` of each row of ``logits`` in the loop's dtype, computed (and checked for NaN/inf)
    on first access and kept: rows the rejection sampler never reaches are never read.
    ``probabilities``: the graph's softmax of the same rows, used as they are where the warp
    would not change them (temperature 1, no filters)."""

    def __init__(
        self,
        logits: np.ndarray | None,
        sampling: SamplingParams,
        model: str,
        probabilities: np.ndarray | None = None,
    ) -> None:
        self._logits = logits
        self._sampling = sampling
        self._model = model
        self._rows: dict[int, np.ndarray] = {}
        self._probabilities = probabilities if sampling.identity_warp else None

    def __getitem__(self, index: int) -> np.ndarray:
        row = self._rows.get(index)
        if row is None:
            if self._probabilities is not None:
                row = self._probabilities[index]
                logits = None if self._logits is None else self._logits[index]  # a device's
                check_probabilities(row, logits, self._model)
            else:
                s = self._sampling
                logits = self._logits[index]
                row = warp(
                    logits, s.temperature, s.top_k, s.top_p, self._model, LOOP_DTYPE, s.min_p
                )
            self._rows[index] = row
        return row


Draws = np.random.Generator | KeyedDraws  # a row's random stream, or a seeded row's keyed draws


def row_draws(config: GenerationConfig, rng: np.random.Generator) -> Draws:
    """How a row samples: a seeded sampled row by draws keyed by position (`KeyedDraws`: its
    tokens are the target alone's under the seed, whatever is drafted), others from ``rng``."""
    return KeyedDraws(rng) if config.reproducible else rng

r"""Verification: which draft tokens the target keeps, and the token it emits after them.

Given draft tokens :math:`x_1..x_K`, the draft distributions :math:`q_i` they were drawn from,
and the target's logits for the K+1 positions from ONE target pass (warped into
:math:`p_1..p_{K+1}` by the same temperature / top-k / top-p the draft got):

* accept :math:`x_i` with probability :math:`\min(1, p_i(x_i) / q_i(x_i))`, in order;
* at the first rejection :math:`n`, emit a *recovered* token from the residual
  :math:`\mathrm{norm}(\max(0, p_n - q_n))` and stop;
* if all K are accepted, emit a *bonus* token from :math:`p_{K+1}`.

Every emitted token then follows :math:`p` exactly (Leviathan et al. 2023, Chen et al. 2023):
:math:`P(y) = q(y)\min(1, p(y)/q(y)) + (1 - \sum_x \min(q(x), p(x)))\,r(y) = p(y)`.

A proposer that picks its tokens without a distribution (prompt lookup, the suffix cache) is a
point mass :math:`q_i = \delta_{x_i}`: the same rule then accepts :math:`x_i` with probability
:math:`p_i(x_i)` and otherwise emits from :math:`p_i` with :math:`x_i` removed and renormalised.
Such tokens come with ``None`` for their distribution (and need no ``[V]`` one-hot row).

Greedy decoding is the temperature-0 limit: accept while :math:`x_i = \arg\max p_i`; the
recovered or bonus token is :math:`\arg\max p_i`.

A seeded row (`KeyedDraws`) is verified by coupling instead: the target draws its own token at
each position with the noise the draft drew with there, keeps the draft tokens while they are
those draws and emits its draw after them. Every token is then the target's own draw (exact by
construction, and the same as the target alone would draw under that seed); the draft only
decides how many are kept per pass (slightly fewer than rejection sampling keeps:
docs/python-api.md, "Seeded sampling").

Guards: :math:`q_i(x_i) = 0` rejects (no division by zero); a residual that sums to zero (only
possible when p == q up to rounding, where rejection has a probability of rounding size) falls
back to :math:`p_i`; NaN/inf logits raise `NumericalError`, never become a token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrt.backends import Forward
from specrt.runtime.config import SamplingParams
from specrt.runtime.sampling import KeyedDraws, WarpedRows, greedy_tokens, sample


def verify(
    draft_tokens: list[int],
    draft_probabilities: Sequence[np.ndarray | None] | None,
    target: Forward,
    sampling: SamplingParams,
    rng: np.random.Generator | KeyedDraws,
    position: int = 0,
) -> tuple[int, int]:
    """Return (how many of the K ``draft_tokens`` are accepted, the token emitted after them).

    ``target``: the target's pass over the positions of the last accepted token and the K draft
    tokens: its logits ``[K+1, V]``, or its own argmax per row where the backend computed them
    (greedy), and its softmax (used instead of warping where the warp is the identity).
    ``draft_probabilities``: per draft token the warped distribution it was drawn from
    (``[K, V]``), or None for a point mass; None alone: every token is one (unused when
    greedy). K may
    be 0 (a plain decoding step). Sampling draws one uniform per position tested, then one for
    the emitted token; the target's rows are warped only as far as the test reaches (most
    rounds stop early). ``rng`` may be a seeded row's `KeyedDraws` instead (coupled
    verification, see the module; ``position``: the sequence position of the first of the K+1).
    """
    if sampling.greedy:
        return accept_greedy(draft_tokens, greedy_tokens(target, "target"))

    p = WarpedRows(target.logits, sampling, "target", target.probabilities)
    if isinstance(rng, KeyedDraws):
        rng.release(position)
        for i in range(len(draft_tokens) + 1):
            token = rng.token(p[i], position + i)
            if i == len(draft_tokens) or draft_tokens[i] != token:
                return i, token
    for i, x in enumerate(draft_tokens):
        p_i = p[i]
        q_i = None if draft_probabilities is None else draft_probabilities[i]
        if q_i is None:  # a point mass: q(x) = 1
            if not rng.random() < p_i[x]:
                return i, sample(without(p_i, x), rng)
        elif not rng.random() < acceptance_probability(p_i[x], q_i[x]):
            return i, sample(residual_distribution(p_i, q_i), rng)
    return len(draft_tokens), sample(p[len(draft_tokens)], rng)


def accept_greedy(draft_tokens: list[int], choice: list[int]) -> tuple[int, int]:
    """Greedy verification given the target's pick at each of the K+1 positions: keep draft
    tokens while they are the pick; emit the pick after them."""
    accepted = 0
    for drafted, wanted in zip(draft_tokens, choice):
        if drafted != wanted:
            break
        accepted += 1
    return accepted, choice[accepted]


def acceptance_probability(p_of_x: float, q_of_x: float) -> float:
    """min(1, p(x)/q(x)); 0 where q(x) == 0."""
    return min(1.0, p_of_x / q_of_x) if q_of_x > 0 else 0.0


def without(p: np.ndarray, x: int) -> np.ndarray:
    """norm(max(0, p - one_hot(x))): ``p`` with ``x`` removed and renormalised; ``p`` itself
    when nothing else has mass (then x was accepted with probability 1)."""
    rest = p.copy()
    rest[x] = 0.0
    total = rest.sum()
    return rest / total if total > 0 else p


def residual_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)); falls back to p when the residual has no mass."""
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    return residual / total if total > 0 else p

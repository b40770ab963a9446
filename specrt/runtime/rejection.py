r"""The rejection sampler: which draft tokens the target keeps, and what it emits after them.

Given draft tokens :math:`x_1..x_K`, the draft distributions :math:`q_i` they were drawn from,
and the target distributions :math:`p_1..p_{K+1}` from ONE target pass:

* accept :math:`x_i` with probability :math:`\min(1, p_i(x_i) / q_i(x_i))`, in order;
* at the first rejection :math:`n`, emit a token from the residual
  :math:`\mathrm{norm}(\max(0, p_n - q_n))` and stop;
* if all K are accepted, emit a bonus token from :math:`p_{K+1}`.

Every emitted token then follows :math:`p` exactly (Leviathan et al. 2023, Chen et al. 2023):
:math:`P(y) = q(y)\min(1, p(y)/q(y)) + (1 - \sum_x \min(q(x), p(x)))\,r(y) = p(y)`.

Guards: :math:`q_i(x_i) = 0` rejects (no division by zero); a residual that sums to zero (only
possible when p == q up to rounding, where rejection has probability 0) falls back to :math:`p_i`.
Greedy decoding is the temperature-0 limit: accept while :math:`x_i = \arg\max p_i`, and the
correction or bonus token is :math:`\arg\max p_i`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from specrt.runtime.sampling import greedy_choice, sample


class Rows(Protocol):
    def __getitem__(self, index: int) -> np.ndarray: ...


def acceptance_probabilities(p_of_x: np.ndarray, q_of_x: np.ndarray) -> np.ndarray:
    """min(1, p(x)/q(x)) elementwise, 0 where q(x) == 0."""
    safe_q = np.where(q_of_x > 0, q_of_x, 1.0)
    return np.where(q_of_x > 0, np.minimum(1.0, p_of_x / safe_q), 0.0)


def residual_distribution(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)); falls back to p when the residual has no mass."""
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    return residual / total if total > 0 else p


def rejection_sample(
    draft_tokens: np.ndarray, q: np.ndarray, p: Rows, rng: np.random.Generator
) -> tuple[int, int]:
    """Verify K draft tokens against the target; return (number accepted, next token).

    ``draft_tokens``: [K] ints; ``q``: [K, V] draft probabilities; ``p``: [K+1, V] target
    probabilities, or any ``p[i] -> row`` (e.g. `WarpedRows`, which computes a row only when the
    sampler reaches it: most rounds stop early). K may be 0 (plain sampling from ``p[0]``).
    One uniform draw per position tested, then one for the emitted token.
    """
    k = len(draft_tokens)
    for i, x in enumerate(draft_tokens.tolist()):
        p_i, q_x = p[i], q[i, x]
        accept = min(1.0, p_i[x] / q_x) if q_x > 0 else 0.0
        if not rng.random() < accept:
            return i, sample(residual_distribution(p_i, q[i]), rng)
    return k, sample(p[k], rng)


def greedy_verify(draft_tokens: np.ndarray, target_logits: np.ndarray) -> tuple[int, int]:
    """Greedy rule: accept while the draft token is the target's argmax; emit the argmax next."""
    best = greedy_choice(target_logits, "target")
    return greedy_accept(draft_tokens.tolist(), best)


def greedy_accept(draft_tokens: list[int], target_choice: list[int]) -> tuple[int, int]:
    """`greedy_verify` given the target's argmax at each of the K+1 positions."""
    n = 0
    for drafted, wanted in zip(draft_tokens, target_choice):
        if drafted != wanted:
            break
        n += 1
    return n, target_choice[n]

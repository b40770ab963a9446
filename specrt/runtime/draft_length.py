r"""Adaptive draft length: choose K each round to maximise expected tokens per unit of time.

With :math:`a_i` the probability that draft position i is accepted given the positions before it
were, a round drafting K tokens emits :math:`E(K) = 1 + \sum_{j=1}^{K} \prod_{i \le j} a_i`
tokens and costs :math:`T(K) = t_{verify}(K) + K\,t_{draft}`. Each round picks
:math:`\arg\max_K E(K)/T(K)` over :math:`0..K_{max}` (K = 0 is a plain target step: right while
the draft keeps missing). The :math:`a_i` are decayed counts of what recent rounds accepted, pulled
back towards a prior while K = 0 (so drafting is retried); the times are moving averages of the
measured calls. The choice thus follows both the text (boilerplate vs. hard code) and the machine.
"""

from __future__ import annotations

import numpy as np


class DraftLengthController:
    def __init__(
        self,
        k_max: int,
        prior_acceptance: float = 0.6,
        prior_weight: float = 2.0,
        decay: float = 0.9,
        smoothing: float = 0.2,
    ) -> None:
        self.k_max = k_max
        self.decay = decay
        self.smoothing = smoothing
        self.prior_accepted = np.full(k_max, prior_acceptance * prior_weight)
        self.prior_tried = np.full(k_max, prior_weight)
        self.accepted = self.prior_accepted.copy()
        self.tried = self.prior_tried.copy()
        self.draft_step_s: float | None = None
        self.verify_s = np.full(k_max + 1, np.nan)  # moving average per K

    def choose(self) -> int:
        if self.k_max == 0:
            return 0
        if self.draft_step_s is None:
            return max(1, self.k_max // 2)  # first round: measure the costs
        known = np.flatnonzero(~np.isnan(self.verify_s))
        nearest = known[np.abs(np.arange(self.k_max + 1)[:, None] - known[None]).argmin(axis=1)]
        verify = self.verify_s[nearest]
        survival = np.cumprod(self.accepted / self.tried)  # P(first j positions all accepted)
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(survival)])  # E(K) for K = 0..k_max
        cost = verify + np.arange(self.k_max + 1) * self.draft_step_s
        return int(np.argmax(expected / cost))

    def update(
        self, drafted: int, accepted: int, draft_time_s: float, verify_time_s: float
    ) -> None:
        """Record a round: ``drafted`` proposed, ``accepted`` kept, and what each part took."""
        self.accepted = self.decay * self.accepted
        self.tried = self.decay * self.tried
        if drafted:
            reached = min(accepted + 1, drafted)  # positions whose accept/reject was decided
            self.tried[:reached] += 1
            self.accepted[:accepted] += 1
            per_step = draft_time_s / drafted
            self.draft_step_s = _average(self.draft_step_s, per_step, self.smoothing)
        else:  # no evidence this round: drift back to the prior so drafting gets retried
            self.accepted += (1 - self.decay) * self.prior_accepted
            self.tried += (1 - self.decay) * self.prior_tried
        old = self.verify_s[drafted]
        self.verify_s[drafted] = _average(
            None if np.isnan(old) else old, verify_time_s, self.smoothing
        )


def _average(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new

"""The target's log-probabilities of each new token, and of the most likely tokens at its
position (OpenAI's ``logprobs``). They are the model's own distribution, before temperature,
top-k or top-p, as vLLM returns them by default, read from the very pass that verified the
token: a round's target call computes every position it emits, so they cost no model call."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MAX_LOGPROBS = 20  # most likely tokens a position may list (OpenAI's top_logprobs limit)


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # most likely first

    def to_dict(self) -> dict:
        return {"token_id": self.token, "logprob": self.logprob, "top": self.top}


def token_logprobs(logits: np.ndarray, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each of ``tokens`` with its log-probability under ``logits [len(tokens), V]`` (row i
    the distribution it was chosen from), and the ``top`` most likely tokens of that row (ties:
    the lower id first). Only the log-sum-exp is taken over the vocabulary, and the top by a
    partition of the values: a whole log-softmax and an argpartition of each row cost ~0.9 ms a
    token at 49152 (CHANGELOG.md, 2026-12-07)."""
    rows = np.asarray(logits[: len(tokens)], dtype=np.float32)
    vocab = rows.shape[-1]
    out = []
    for row, token in zip(rows, tokens):
        peak = float(row.max())
        total = np.exp(row - peak).sum(dtype=np.float64)  # 10^5 terms: summed in float64
        lse = peak + math.log(float(total))
        best: list[tuple[int, float]] = []
        if top:
            kth = np.partition(row, vocab - top)[vocab - top]
            ids = np.flatnonzero(row >= kth)  # the top, and any tied with the last of them
            ids = ids[np.argsort(-row[ids], kind="stable")][:top]
            best = [(int(i), float(row[i]) - lse) for i in ids]
        out.append(TokenLogprob(int(token), float(row[token]) - lse, best))
    return out


def echoed_entries(prompt: list[int], entries: list[TokenLogprob | None]) -> list[TokenLogprob]:
    """A prompt's entries (``prompt_logprobs``) as an echo lists them: its first token's with
    no value (OpenAI's ``null``), which nothing predicts."""
    return [TokenLogprob(prompt[0], None, None), *entries[1:]]

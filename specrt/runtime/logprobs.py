"""The target's log-probabilities of each new token, and of the most likely tokens at its
position (OpenAI's ``logprobs``). They are the model's own distribution, before temperature,
top-k or top-p, as vLLM returns them by default, read from the very pass that verified the
token: a round's target call computes every position it emits, so they cost no model call."""

from __future__ import annotations

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
    the distribution it was chosen from), and the ``top`` most likely tokens of that row."""
    rows = np.asarray(logits[: len(tokens)], dtype=np.float32)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    # log-softmax; the sum in float64 (a vocabulary of 10^5 terms)
    logs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float64))
    out = []
    for row, token in zip(logs, tokens):
        best: list[tuple[int, float]] = []
        if top:
            ids = np.argpartition(-row, top - 1)[:top]
            ids = ids[np.argsort(-row[ids], kind="stable")]
            best = [(int(i), float(row[i])) for i in ids]
        out.append(TokenLogprob(int(token), float(row[token]), best))
    return out

"""Logits processors of the OpenAI API and vLLM: ``logit_bias`` and the repetition, frequency
and presence penalties, applied to the target's logits before sampling or the argmax.

They change the target's distribution, so the output is that of the target alone with the same
processors: a verification pass applies them at each of its positions as if the proposal before
that position had been generated (the penalties count it), and the rejection sampler then
compares against the processed distribution. Order as vLLM's: the bias, then the repetition
penalty (on every token of the prompt and the output: a positive logit divided by it, a
negative one multiplied), then the frequency and presence penalties (on the output's tokens:
minus ``frequency`` times the count, minus ``presence`` once present). The log-probabilities a
row asks for stay the model's own (vLLM's default).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LogitsProcessors:
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def active(self) -> bool:
        return bool(self.logit_bias) or self.penalized

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def apply(
        self, logits: np.ndarray, tokens: list[int], prompt_length: int, proposal: list[int]
    ) -> np.ndarray:
        """``logits [m, V]`` processed, a new float32 array: row j as after ``tokens`` (the
        row so far, its first ``prompt_length`` the prompt) and ``proposal[:j]``."""
        out = np.array(logits, dtype=np.float32)
        vocab = out.shape[-1]
        if self.logit_bias:
            ids, values = zip(*self.logit_bias)
            out[:, list(ids)] += np.asarray(values, dtype=np.float32)
        if not self.penalized:
            return out
        counts = np.bincount(np.asarray(tokens[prompt_length:], dtype=np.int64), minlength=vocab)
        in_prompt = np.zeros(vocab, dtype=bool)
        in_prompt[np.asarray(tokens[:prompt_length], dtype=np.int64)] = True
        for j, row in enumerate(out):
            if j:  # the proposal before this position counts as generated
                counts[proposal[j - 1]] += 1
            if self.repetition_penalty != 1.0:
                seen = in_prompt | (counts > 0)
                scores = row[seen]
                row[seen] = np.where(
                    scores > 0, scores / self.repetition_penalty, scores * self.repetition_penalty
                )
            if self.frequency_penalty:
                row -= np.float32(self.frequency_penalty) * counts.astype(np.float32)
            if self.presence_penalty:
                row -= np.float32(self.presence_penalty) * (counts > 0)
        return out

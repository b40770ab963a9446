"""Logits processors of the OpenAI API and vLLM: ``logit_bias`` and the repetition, frequency
and presence penalties, applied to the target's logits before sampling or the argmax.

They change the target's distribution, so the output is that of the target alone with the same
processors: a verification pass applies them at each of its positions as if the proposal before
that position had been generated (the penalties count it), and the rejection sampler then
compares against the processed distribution. Order as vLLM's: ``min_tokens`` (EOS and the
stop tokens held off until that many new tokens), the bias, then the repetition
penalty (on every token of the prompt and the output: a positive logit divided by it, a
negative one multiplied), then the frequency and presence penalties (on the output's tokens:
minus ``frequency`` times the count, minus ``presence`` once present), then a structured
output's grammar (`specrt.runtime.grammar`: -inf for the tokens it does not allow). The
log-probabilities a row asks for stay the model's own (vLLM's default).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from specrt.runtime.grammar import GrammarState


@dataclass(frozen=True)
class LogitsProcessors:
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0  # new tokens before which ``ends`` cannot be drawn (vLLM's)
    ends: tuple[int, ...] = ()  # EOS (unless ignored) and the stop tokens
    grammar: GrammarState | None = field(default=None, compare=False)  # the row's own

    @property
    def active(self) -> bool:
        ended = bool(self.min_tokens and self.ends)
        return bool(self.logit_bias) or self.penalized or ended or self.grammar is not None

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def apply(
        self,
        logits: np.ndarray,
        tokens: list[int],
        prompt_length: int,
        proposal: list[int],
        draft: bool = False,
    ) -> np.ndarray:
        """``logits [m, V]`` processed in place (and returned): row j as after ``tokens``
        (the row so far, its first ``prompt_length`` the prompt) and ``proposal[:j]``. Only
        the tokens the row holds are touched, and nothing is allocated the vocabulary's size:
        a pass over it, or a fresh copy (its page faults), cost a tenth of a small target's
        step (CHANGELOG.md, 2026-12-07). ``draft``: a draft step's logits (a grammar with no
        way on leaves them as they are; the target's raise `GrammarDeadEnd`)."""
        out = logits
        if self.min_tokens and self.ends:  # too few new tokens yet: no end may come
            made = len(tokens) - prompt_length
            ends = [t for t in self.ends if t < out.shape[-1]]
            for j in range(max(0, min(len(out), self.min_tokens - made))):
                out[j, ends] = -np.inf
        if self.logit_bias:
            ids, values = zip(*self.logit_bias)
            out[:, list(ids)] += np.asarray(values, dtype=out.dtype)
        if self.penalized:
            self._penalize(out, tokens, prompt_length, proposal)
        if self.grammar is not None:
            self.grammar.apply(out, tokens[prompt_length:], proposal, draft)
        return out

    def _penalize(
        self, out: np.ndarray, tokens: list[int], prompt_length: int, proposal: list[int]
    ) -> None:
        seen, counts = set(tokens), Counter(tokens[prompt_length:])
        for j, row in enumerate(out):
            if j:  # the proposal before this position counts as generated
                seen.add(proposal[j - 1])
                counts[proposal[j - 1]] += 1
            if self.repetition_penalty != 1.0:
                ids = np.fromiter(seen, np.int64, len(seen))
                scores = row[ids]
                penalty = out.dtype.type(self.repetition_penalty)
                row[ids] = np.where(scores > 0, scores / penalty, scores * penalty)
            if counts and (self.frequency_penalty or self.presence_penalty):
                ids = np.fromiter(counts, np.int64, len(counts))
                times = np.fromiter(counts.values(), np.float64, len(counts))
                cut = self.frequency_penalty * times + self.presence_penalty
                row[ids] -= cut.astype(out.dtype)

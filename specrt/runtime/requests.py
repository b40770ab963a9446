"""A request, and the row it becomes while it is generated (what the round engine and its
planner read and update)."""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from specrt.errors import InvalidInputError
from specrt.runtime.config import GenerationConfig
from specrt.runtime.hybrid import NO_MATCH_YET, HybridChoice
from specrt.runtime.logprobs import TokenLogprob
from specrt.runtime.lookup import NgramIndex
from specrt.runtime.results import GenerationStats
from specrt.runtime.round import RowRound
from specrt.runtime.sampling import row_draws
from specrt.runtime.schedules import DraftSchedule
from specrt.runtime.schedules.guard import SpeculationGuard
from specrt.runtime.stopping import StopStrings


@dataclass
class Request:
    """One sequence to generate: ``key`` names it in the results, ``prompt`` is its text or its
    token ids (checked: see `SpeculativeGenerator.encode_prompts`), ``config`` its settings.
    ``rng``: its random stream, by default its own, keyed by ``config.seed`` where it has one
    (a seeded row's tokens are the target alone's under that seed)."""

    key: Hashable
    prompt: str | list[int]
    config: GenerationConfig = field(default_factory=GenerationConfig)
    rng: np.random.Generator | None = None
    # The stream is keyed by the seed, not given: each run starts it afresh (`fresh`)
    keyed: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.rng is None and isinstance(self.config, GenerationConfig):
            seed = self.config.seed
            self.rng = np.random.default_rng(None if seed is None else [seed, 0])
            self.keyed = seed is not None

    def fresh(self) -> Request:
        """This request as a new run takes it: a stream keyed by its seed starts again (a run
        draws from it: run twice, the same Request gave other tokens), one given is kept."""
        return replace(self, rng=None) if self.keyed else self


class LoneLearners(NamedTuple):
    """What a row's rounds alone learn with, kept by the generator per settings (what they
    learn holds for the pair): the hybrid's choice (None unless "hybrid"), the draft schedule,
    and the guard against decoding slower than the target alone (None unless "adaptive")."""

    hybrid: HybridChoice | None
    schedule: DraftSchedule
    guard: SpeculationGuard | None


@dataclass
class Row:
    """A request being generated: its tokens so far, where it stops, how its rounds go."""

    request: Request
    tokens: list[int]
    limit: int  # the length at which it stops
    drafting: bool
    stats: GenerationStats
    started: float
    stopper: StopStrings | None = None
    index: NgramIndex | None = None  # prompt lookup over the row's text, unless "model"
    match_history: int = NO_MATCH_YET  # how its last match fared (`hybrid.outcome`), if any
    finish_reason: str = ""
    text: str | None = None  # cut before a stop string
    error: str | None = None  # why it failed (finish reason "error")
    alone: LoneLearners | None = None  # what it runs alone with, once it does
    logprobs: list[TokenLogprob] | None = None  # of its new tokens, where it asks for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # of its prompt's, if asked
    round: RowRound = field(init=False)

    def __post_init__(self) -> None:
        config = self.request.config
        rng = row_draws(config, self.request.rng)
        self.round = RowRound(
            self.tokens,
            config.sampling,
            rng,
            0,
            logprobs=config.logprobs,
            processors=config.processors,
            prompt_length=len(self.request.prompt),
        )
        if config.logprobs is not None:
            self.logprobs = []


def token_ids(name: str, prompt: object, vocab_size: int) -> list[int]:
    """A prompt given as token ids, checked: a list of integers in the vocabulary."""
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1:
        prompt = prompt.tolist()
    if isinstance(prompt, (bytes, bytearray, dict)) or not isinstance(prompt, Sequence):
        raise InvalidInputError(
            f"{name} is {type(prompt).__name__}; a prompt is a string or a list of token ids"
        )
    ids = []
    for token in prompt:
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise InvalidInputError(f"{name} has a token id {token!r} that is not an integer")
        ids.append(int(token))
    if not ids:
        raise InvalidInputError(f"{name} is empty; give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidInputError(
            f"{name} has token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})"
        )
    return ids

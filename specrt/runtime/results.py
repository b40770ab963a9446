"""What a generation returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specrt.runtime.logprobs import TokenLogprob


@dataclass
class GenerationStats:
    """Counters of one request. Meanings follow vLLM's spec-decode metrics.

    rounds: target passes after the prefill (the first new token's plain step included);
    draft_rounds: those that verified drafts.
    drafted_tokens / accepted_tokens: draft tokens proposed / kept by the target.
    acceptance_rate: accepted_tokens / drafted_tokens.
    mean_accepted_tokens: draft tokens accepted per round (0..K).
    tokens_per_round: tokens emitted per target pass (accepted + the corrected or bonus token).
    accepted_per_position: how often draft position i (0-based) was accepted.
    wall_time_s / tokens_per_second: generation wall time (prefill included), new tokens / it.
    cached_tokens: prompt tokens the target did not read, their cache copied from a row that
    holds them (a running row, one admitted beside it, a finished one kept: `prefixes`).
    draft_stopped: the sequence reached the draft model's max positions (or the prompt alone did),
    so the target decoded from there on alone.
    proposers: per proposer ("model", "lookup", "suffix", "corpus", "grammar": the tokens a
    structured output forces) of the rounds it drafted: rounds, proposed and accepted tokens,
    accepted_per_position (as long as the whole request's).
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    draft_rounds: int = 0  # of them, rounds that verified draft tokens
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_tokens: float = 0.0
    tokens_per_round: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    wall_time_s: float = 0.0
    tokens_per_second: float = 0.0
    draft_stopped: bool = False
    proposers: dict[str, dict] = field(default_factory=dict)

    def add_round(self, drafted: int, accepted: int, source: str = "model") -> None:
        self.rounds += 1
        self.draft_rounds += drafted > 0
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        for position in range(accepted):
            if position == len(self.accepted_per_position):  # a match may outrun K
                self.accepted_per_position.append(0)
            self.accepted_per_position[position] += 1
        if drafted:
            add_proposer_round(self.proposers, source, drafted, accepted)

    def finish(self, wall_time_s: float) -> None:
        self.wall_time_s = wall_time_s
        self.acceptance_rate = (
            self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0
        )
        self.mean_accepted_tokens = self.accepted_tokens / self.rounds if self.rounds else 0.0
        self.tokens_per_round = self.new_tokens / self.rounds if self.rounds else 0.0
        self.tokens_per_second = self.new_tokens / wall_time_s if wall_time_s > 0 else 0.0
        width = len(self.accepted_per_position)  # each proposer's positions, as many (0..K-1)
        for entry in self.proposers.values():
            by_position = entry["accepted_per_position"]
            by_position.extend([0] * (width - len(by_position)))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def total(cls, parts: list[GenerationStats]) -> GenerationStats:
        """The counters of requests for one prompt (an OpenAI request's ``n`` choices) as one:
        its prompt once (as the first read it), the rest summed; wall time the longest."""
        total = cls(prompt_tokens=parts[0].prompt_tokens, cached_tokens=parts[0].cached_tokens)
        for part in parts:
            for name in _SUMMED:
                setattr(total, name, getattr(total, name) + getattr(part, name))
            _add_counts(total.accepted_per_position, part.accepted_per_position)
            total.draft_stopped |= part.draft_stopped
            for source, entry in part.proposers.items():
                into = _proposer(total.proposers, source)
                for name in ("rounds", "proposed", "accepted"):
                    into[name] += entry[name]
                _add_counts(into["accepted_per_position"], entry["accepted_per_position"])
        total.finish(max(part.wall_time_s for part in parts))
        return total


_SUMMED = ("new_tokens", "rounds", "draft_rounds", "drafted_tokens", "accepted_tokens")


def _add_counts(into: list[int], counts: list[int]) -> None:
    """``into[i] += counts[i]``, ``into`` grown as needed."""
    into.extend([0] * (len(counts) - len(into)))
    for i, count in enumerate(counts):
        into[i] += count


def _proposer(table: dict[str, dict], source: str) -> dict:
    """``source``'s entry in ``table`` (as `GenerationStats.proposers`), new ones at zero."""
    empty = {"rounds": 0, "proposed": 0, "accepted": 0, "accepted_per_position": []}
    return table.setdefault(source, empty)


def add_proposer_round(table: dict[str, dict], source: str, drafted: int, accepted: int) -> None:
    """Count a drafting round of ``source`` in ``table`` (as `GenerationStats.proposers`)."""
    entry = _proposer(table, source)
    entry["rounds"] += 1
    entry["proposed"] += drafted
    entry["accepted"] += accepted
    by_position = entry["accepted_per_position"]
    by_position.extend([0] * (accepted - len(by_position)))
    for position in range(accepted):
        by_position[position] += 1


@dataclass
class GenerationResult:
    text: str
    # The new tokens only; with a stop string, every token generated up to the one that
    # completed it (the text ends before the string, which may start inside a token), as vLLM's
    token_ids: list[int]
    # "stop" (EOS or a stop string), "length" (max_new_tokens or the model's max positions);
    # also "cancelled" (a Service request cancelled) and "error" (see below)
    finish_reason: str
    stats: GenerationStats
    # `SpeculativeGenerator.run` only: why this row failed alone (finish reason "error": its
    # logits came out NaN/inf) while the rows beside it went on.
    error: str | None = None
    # Where the config asks (``logprobs``): each new token's, as `token_ids` (`logprobs`)
    logprobs: list[TokenLogprob] | None = None
    # Where the config asks (``prompt_logprobs``): each prompt token's, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def to_dict(self) -> dict:
        if self.error is not None:
            return {"error": {"message": self.error}}
        record = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }
        if self.logprobs is not None:
            record["logprobs"] = [entry.to_dict() for entry in self.logprobs]
        if self.prompt_logprobs is not None:
            record["prompt_logprobs"] = [e and e.to_dict() for e in self.prompt_logprobs]
        return record

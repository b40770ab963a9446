"""Stop strings: a row ends where its new text first contains one of them.

A speculative round emits several tokens at once, and a stop string may end inside any of
them or span several: the text is searched after every round from just before where the last
search ended, and the row keeps the tokens up to the one that completed the stop string; its
text ends where the stop string begins (it is not part of the output, as in the OpenAI API).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specrt.runtime.config import GenerationConfig


class StopStrings:
    """The stop strings of one row, searched in its new text as tokens arrive."""

    def __init__(
        self, stops: Sequence[str], decode: Callable[[list[int]], str], included: bool = False
    ) -> None:
        self.stops = tuple(stops)
        self.decode = decode
        self.included = included  # the text ends after the stop string
        self._longest = max(map(len, self.stops))
        self._searched = 0  # tokens already searched
        self._text_length = 0  # length of their text

    @classmethod
    def of(cls, config: GenerationConfig, tokenizer) -> StopStrings | None:
        """The stop strings of a row's ``config``, searched in its text as it shows it (None:
        none)."""
        if not config.stop:
            return None
        decode = tokenizer.incremental(config.skip_special_tokens)
        return cls(config.stop, decode, config.include_stop_str_in_output)

    def check(self, new_ids: list[int]) -> tuple[int, str] | None:
        """``(tokens to keep, text)`` when a stop string has appeared in the text of
        ``new_ids`` (the row's new tokens so far), else None."""
        start = max(0, self._text_length - self._longest + 1)
        text = self.decode(new_ids)
        if self._find(text, start) is None:
            self._searched, self._text_length = len(new_ids), len(text)
            return None
        # The fewest tokens whose text holds the stop string: one of this round's.
        for keep in range(self._searched + 1, len(new_ids) + 1):
            text = self.decode(new_ids[:keep])
            found = self._find(text, start)
            if found is not None:
                return keep, text[:found]
        return len(new_ids), text[: self._find(text, start)]

    def _find(self, text: str, start: int) -> int | None:
        """Where the text ends: where the first stop string in it begins (or, ``included``,
        where the first to begin ends)."""
        hits = [(index, stop) for stop in self.stops if (index := text.find(stop, start)) >= 0]
        if not hits:
            return None
        index, stop = min(hits, key=lambda hit: (hit[0], len(hit[1])))
        return index + len(stop) if self.included else index


@dataclass
class Settled:
    """What stands of a round: ``count`` of its tokens; ``stopped`` at EOS or a stop string;
    ``text``: the row's text cut before the stop string (None: decode the tokens)."""

    count: int
    stopped: bool = False
    text: str | None = None


def settle(
    tokens: list[int],
    prompt_length: int,
    emitted: list[int],
    eos_token_ids: frozenset[int],
    config: GenerationConfig,
    stopper: StopStrings | None,
) -> Settled:
    """Append a round's ``emitted`` tokens to the row's ``tokens``, up to and including the
    first EOS (unless EOS is ignored) or stop token, and up to the token that completes a stop
    string."""
    eos = None
    ends = config.ends(eos_token_ids)
    if not ends.isdisjoint(emitted):
        eos = next(i for i, t in enumerate(emitted) if t in ends)
        emitted = emitted[: eos + 1]
    before = len(tokens)
    tokens.extend(emitted)
    if stopper is not None and (hit := stopper.check(tokens[prompt_length:])):
        kept, text = hit
        del tokens[prompt_length + kept :]
        return Settled(len(tokens) - before, True, text)
    return Settled(len(emitted), eos is not None)


def answer_text(tokenizer, new_ids: list[int], config: GenerationConfig, eos_token_ids) -> str:
    """A row's text as its config shows it (`text_ids`); "" without a tokenizer."""
    if tokenizer is None:
        return ""
    return tokenizer.decode(text_ids(new_ids, config, eos_token_ids), config.skip_special_tokens)


def text_ids(new_ids: list[int], config: GenerationConfig, eos_token_ids) -> list[int]:
    """The new tokens a row's text shows: all of them but the EOS or stop token that ended the
    row, as vLLM leaves it out (a stop token may be plain text: a newline), unless
    ``include_stop_str_in_output``."""
    if config.include_stop_str_in_output or not new_ids:
        return new_ids
    return new_ids[:-1] if new_ids[-1] in config.ends(eos_token_ids) else new_ids

"""Text as it is generated: deltas that concatenate to the final text exactly.

A round accepts several tokens at once; their text is the new part of the decoded sequence.
Two things are held back until later tokens decide them: an incomplete UTF-8 character (the
tokenizer decodes the half it has as U+FFFD) and a tail that could be the start of a stop
string (it is not output if the stop string completes). The final text, cut before a stop
string if one was found, settles the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextDeltas:
    """The text of one row's new tokens, handed out in pieces."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stops = tuple(stops)
        self.sent = ""

    def update(self, new_ids: list[int]) -> str:
        """The text of ``new_ids`` (all the row's new tokens so far) not sent yet, minus what
        later tokens may still change."""
        text = self.decode(new_ids)
        end = len(text)
        while end and text[end - 1] == REPLACEMENT:  # an incomplete character so far
            end -= 1
        end -= self._stop_prefix(text[:end])
        return self._send(text[:end])

    def finish(self, final_text: str) -> str:
        """The rest of the row's final text."""
        return self._send(final_text)

    def _send(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""  # nothing new, or a decode that changed earlier text: wait for more
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[-size:]):
                    longest = size
                    break
        return longest

"""The bundle's tokenizer, loaded with `tokenizers` alone (no transformers, no torch)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from specrt.bundle import TokenizerSpec
from specrt.checksums import vocab_fingerprint
from specrt.errors import BundleError, InvalidInputError


class BundleTokenizer:
    def __init__(self, directory: str | Path, spec: TokenizerSpec) -> None:
        path = Path(directory) / "tokenizer.json"
        if path.is_file() and not os.access(path, os.R_OK):
            raise BundleError(f"cannot read {path} (permission denied); check its permissions")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on a broken file
            raise BundleError(f"cannot load {path}: {exc}; re-export the bundle") from exc
        self.spec = spec
        self.directory = Path(directory)
        self._guidance: dict[tuple, object] = {}

    def encode(
        self, text: str, add_special_tokens: bool = True, counted: bool = False
    ) -> list[int]:
        """``add_special_tokens=False`` for text that has them written out (a chat template's
        output). ``counted``: the text is counted, not run, and may give no tokens."""
        if not isinstance(text, str):
            raise InvalidInputError(f"a prompt must be a string, got {type(text).__name__}")
        # (whitespace is text: a newline or an indent is a fair prompt for code)
        if not text and not counted:
            raise InvalidInputError("the prompt is empty; give some text to continue")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # bytes a terminal passed through undecoded
            raise InvalidInputError(
                f"the prompt {text[:40]!r} is not valid UTF-8 text (at character {exc.start}); "
                "pass UTF-8"
            ) from exc
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if not ids and not counted:
            raise InvalidInputError(f"the prompt {text[:40]!r} encodes to no tokens")
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for, at most: the longest string of
        the vocabulary (a byte-level token's string has a character per byte of its text)."""
        return max(map(len, self._tokenizer.get_vocab(with_added_tokens=True)), default=1)

    @functools.cached_property
    def vocab_fingerprint(self) -> str:
        """See `vocab_fingerprint`."""
        return vocab_fingerprint(self._tokenizer.get_vocab(with_added_tokens=True))

    def guidance(self, eos_token_ids: tuple[int, ...], vocab: int):
        """llguidance's tokenizer of this one (`specrt.runtime.grammar`), built once: it reads
        every token's bytes (a quarter of a second for 49152 tokens)."""
        key = (eos_token_ids, vocab)
        if key not in self._guidance:
            from specrt.runtime.grammar import guidance_tokenizer

            self._guidance[key] = guidance_tokenizer(self._tokenizer, eos_token_ids, vocab)
        return self._guidance[key]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: list[int]) -> list[str | None]:
        """Each id's string in the vocabulary (a byte-level token's as its bytes are spelled
        there, ``Ġ`` for a space), None for an id the vocabulary lacks."""
        return [self._tokenizer.id_to_token(i) for i in ids]

    def incremental(self, skip_special_tokens: bool = True) -> IncrementalDecode:
        """A ``decode`` for one growing row: each token decoded once, not the whole row again
        every round (see `IncrementalDecode`)."""
        return IncrementalDecode(self._tokenizer, skip_special_tokens)


class IncrementalDecode:
    """``decode(ids)`` for a row whose ids grow between calls: the text of the ids not seen yet
    is added to what was decoded before (tokenizers' `DecodeStream`, which decodes a few tokens
    of context with them as the full decode would), so a round costs its own tokens, not the
    row's length. A call with a prefix of the ids seen is answered from the text so far; any
    other list starts over. One difference from a full decode: an incomplete UTF-8 character at
    the end is left out until the tokens that complete it arrive (a full decode shows U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._start()

    def _start(self) -> None:
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        self._ids: list[int] = []
        self._pieces: list[str] = []
        self._ends: list[int] = []  # the text's length once each token is in
        self._length = 0

    def __call__(self, ids: list[int]) -> str:
        seen = len(self._ids)
        if len(ids) <= seen and ids == self._ids[: len(ids)]:
            return self._text()[: self._ends[len(ids) - 1]] if ids else ""
        if ids[:seen] != self._ids:
            self._start()
            seen = 0
        for token in ids[seen:]:
            piece = self._stream.step(self._tokenizer, token)
            if piece:
                self._pieces.append(piece)
                self._length += len(piece)
            self._ends.append(self._length)
        self._ids.extend(ids[seen:])
        return self._text()

    def _text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

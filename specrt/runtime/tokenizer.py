"""The bundle's tokenizer, loaded with `tokenizers` alone (no transformers, no torch)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from specrt.bundle import TokenizerSpec
from specrt.errors import BundleError, InvalidInputError


class BundleTokenizer:
    def __init__(self, directory: str | Path, spec: TokenizerSpec) -> None:
        path = Path(directory) / "tokenizer.json"
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on a broken file
            raise BundleError(f"cannot load {path}: {exc}; re-export the bundle") from exc
        self.spec = spec
        self.directory = Path(directory)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``add_special_tokens=False`` for text that has them written out (a chat template's
        output)."""
        if not isinstance(text, str):
            raise InvalidInputError(f"a prompt must be a string, got {type(text).__name__}")
        if not text.strip():
            raise InvalidInputError("the prompt is empty; give some text to continue")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # bytes a terminal passed through undecoded
            raise InvalidInputError(
                f"the prompt {text[:40]!r} is not valid UTF-8 text (at character {exc.start}); "
                "pass UTF-8"
            ) from exc
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if not ids:
            raise InvalidInputError(f"the prompt {text[:40]!r} encodes to no tokens")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

"""The package's own exception types. Every message says what is wrong and what to do."""

from __future__ import annotations

import errno
import os
import shutil


class SpecrtError(Exception):
    """Base class of every error specrt raises on purpose."""


class BundleError(SpecrtError):
    """A bundle is missing, incomplete, corrupted or inconsistent with its manifest."""


class ExportError(SpecrtError):
    """A checkpoint pair cannot be exported (unsupported, mismatched or numerically wrong)."""


class PairMismatchError(ExportError, BundleError):
    """Draft and target disagree on something they must share (tokenizer, vocabulary)."""


class InvalidInputError(SpecrtError, ValueError):
    """A prompt or a generation parameter is out of range; ``field``: the parameter at fault,
    where there is one (the server names it in its error body)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class RequestError(InvalidInputError):
    """An OpenAI request body specrt cannot answer as asked; ``param``: the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class UnknownSettingError(InvalidInputError, TypeError):
    """A keyword `GenerationConfig` does not have: a TypeError, as any unknown keyword
    argument is, that says which name to use."""


class PromptTooLongError(InvalidInputError):
    """A prompt leaves no room to generate within the positions the models hold."""


class NumericalError(SpecrtError):
    """A model produced NaN or infinite logits."""


class GrammarDeadEnd(NumericalError):
    """A row's structured output cannot go on: no token of the model's vocabulary continues
    it. The row fails alone, as a row with NaN logits does."""


class OverloadedError(SpecrtError):
    """The service's batch and its waiting queue are full: retry later."""


class ServiceClosedError(OverloadedError):
    """The service is closed or closing: a retry on it never succeeds (an `OverloadedError`,
    as it was before it had a class of its own; the server answers it 503, not 429)."""


_OS_ADVICE = {
    errno.ENOSPC: "free some space, or write somewhere else",
    errno.EDQUOT: "free some space, or write somewhere else",
    errno.EROFS: "the file system is read-only: write somewhere else",
    errno.EACCES: "check the permissions, or use another path",
    errno.EPERM: "check the permissions, or use another path",
    errno.ENOENT: "check the path",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
}


def describe_os_error(exc: OSError) -> str:
    """One line for an error of the machine (disk full, read-only, permissions): what and where,
    and what to do."""
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list):
        source, _, why = exc.args[0][0]  # copytree's list of (source, destination, reason)
        return f"copying {source} failed: {why}"
    where = f": {exc.filename}" if exc.filename else ""
    advice = _OS_ADVICE.get(exc.errno)
    return f"{exc.strerror or exc}{where}" + (f" ({advice})" if advice else "")


def unwritable_reason(path: str | os.PathLike) -> str:
    """Why ``path`` (a file or folder there is, that `os.access` says cannot be written) cannot
    be: a read-only file system told apart from permissions, which `os.access` does not."""
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return "read-only file system: write somewhere else"
    return "permission denied"

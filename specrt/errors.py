"""The package's own exception types. Every message says what is wrong and what to do."""


class SpecrtError(Exception):
    """Base class of every error specrt raises on purpose."""


class BundleError(SpecrtError):
    """A bundle is missing, incomplete, corrupted or inconsistent with its manifest."""


class ExportError(SpecrtError):
    """A checkpoint pair cannot be exported (unsupported, mismatched or numerically wrong)."""


class PairMismatchError(ExportError, BundleError):
    """Draft and target disagree on something they must share (tokenizer, vocabulary)."""


class InvalidInputError(SpecrtError, ValueError):
    """A prompt or a generation parameter is out of range."""


class NumericalError(SpecrtError):
    """A model produced NaN or infinite logits."""

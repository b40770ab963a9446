"""A one-row `Decoder` seen as rows of one, so that the round engine drives every backend alike
(the one-row CPU engine, the cuda engine, TensorRT plans, the portable graph): a lone request is a
batch of one."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specrt.backends.base import NEED_LOGITS, Decoder, Forward
from specrt.backends.rows import RowsDecoder


class OneRow:
    """The rows interface of `RowsDecoder` over one `Decoder`'s only row (``max_batch`` 1).

    Everything else (``length``, ``forward``, ``rollback``, the decoder's own attributes) is
    the decoder's."""

    max_batch = 1
    copies_rows = False  # one row: a later prompt's calls start from an empty cache
    resizes = 0  # a one-row cache is allocated whole: no round pays for growing it
    windowed, catch_up_above = RowsDecoder.windowed, RowsDecoder.catch_up_above  # a model's

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder

    def __getattr__(self, name: str):
        return getattr(self.decoder, name)

    @property
    def lengths(self) -> np.ndarray:
        """``[1]``: the row's cached positions (a copy: `set_length` changes it)."""
        return np.array([self.decoder.length], dtype=np.int64)

    def set_length(self, row: int, length: int) -> None:
        self.decoder.rollback(length)

    def prefill_rows(self, start: int, prompts: list[Sequence[int]]) -> None:
        [prompt] = prompts
        if len(prompt):
            self.decoder.prefill(prompt)

    def forward_rows(
        self,
        tokens: np.ndarray,
        keep_last: int = 0,
        fed: np.ndarray | None = None,
        start: int = 0,
        need: str = NEED_LOGITS,
    ) -> Forward:
        """``tokens [1, S]`` (its first ``fed[0]`` real); what `Decoder.forward` returns, with
        a leading row axis: ``logits [1, keep_last, V]``, ``argmax [1, keep_last]``."""
        row = tokens[0] if fed is None else tokens[0, : int(np.asarray(fed).reshape(-1)[0])]
        out = self.decoder.forward(row.tolist(), keep_last=keep_last, need=need)
        arrays = [out.logits, out.probabilities, out.max_logit, out.max_probability]
        logits, probabilities, max_logit, max_probability = (
            None if a is None else a[None] for a in arrays
        )
        argmax = None if out.argmax is None else np.asarray([out.argmax])
        return Forward(logits, probabilities, argmax, max_logit, max_probability)

    def move_row(self, source: int, dest: int) -> None:
        raise AssertionError("a decoder of one row has no other row to move")

    def copy_row(self, source: int, dest: int, length: int | None = None) -> None:
        raise AssertionError("a decoder of one row has no other row to copy")

    def shrink(self, headroom: int = 0, keep: int = 0) -> None:
        pass  # allocated whole

    def reserve(self) -> None:
        pass

    def clear_stale(self) -> None:
        clear = getattr(self.decoder, "clear_stale", None)
        if clear is not None:
            clear()


def as_rows(decoder: Decoder) -> RowsDecoder | OneRow:
    """``decoder`` itself where it runs rows, else its only row as rows of one."""
    return decoder if isinstance(decoder, RowsDecoder) else OneRow(decoder)

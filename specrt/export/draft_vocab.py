"""A draft's reduced vocabulary: the tokens its output layer proposes.

A small draft's output layer is a large part of its step (SmolLM2's 4-layer draft: 49152 rows of
576, about 40% of the step's kernel time on a CPU), yet a chat model's answers draw almost all
their tokens from a few thousand. A draft folder may name the tokens its engine proposes in
`DRAFT_VOCAB_FILE` (`specrt distill` writes the answers' most used ones), or `specrt build
--draft-vocab N` takes the N its bundle's corpus uses most (`CorpusTable.most_used`: for a draft
of the user's own): its graph's output layer then has those rows only, and writes their logits
at the target's ids, `UNPROPOSED` elsewhere, as an EAGLE-3 head's does. Verification reads the
draft's distribution as it comes, so the output stays the target's: only how often a draft is
kept can change. The portable graph (what TensorRT builds from) keeps the whole vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specrt.errors import ExportError

DRAFT_VOCAB_FILE = "draft_vocab.json"


def read_draft_vocab(folder: Path, vocab: int) -> np.ndarray | None:
    """The sorted token ids the draft at ``folder`` proposes, or None where it names none (all
    ``vocab`` of them)."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = np.asarray(json.loads(path.read_text())["token_ids"], dtype=np.int64)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ExportError(
            f'{path}: not a draft vocabulary ({exc}); it holds {{"token_ids": [...]}} '
            "(`specrt distill` writes it): fix or remove it"
        ) from exc
    if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= vocab:
        raise ExportError(
            f"{path}: token ids must be a non-empty list within the vocabulary (0 to "
            f"{vocab - 1}): fix or remove it"
        )
    ids = np.unique(ids)
    return None if len(ids) == vocab else ids


def write_draft_vocab(folder: Path, ids: np.ndarray) -> None:
    (Path(folder) / DRAFT_VOCAB_FILE).write_text(
        json.dumps({"token_ids": sorted(int(i) for i in ids)}) + "\n"
    )


def columns_of(ids: np.ndarray, vocab: int) -> np.ndarray:
    """``[vocab]``: each target token's column among the draft's logits (``ids`` sorted), or
    ``len(ids)`` where the draft never proposes it (`specrt.export.ort_builder._lm_head`)."""
    columns = np.full(vocab, len(ids), dtype=np.int64)
    columns[ids] = np.arange(len(ids))
    return columns

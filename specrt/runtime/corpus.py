"""A bundle's corpus: text its target wrote before (answers to prompts like the ones it will be
sent), kept as a table of what most often followed each context of 1 to `DEPTH` tokens.

Retrieval drafting (REST, SuffixDecoding's static side): where the row's own text has no match,
the most frequent continuation of its last tokens in the corpus is proposed, token by token,
for free. A chat model's answers share phrasing across topics ("Here's a", "In summary,"), which
a row's own text, short and new, does not yet hold. Each proposal carries how strongly the
corpus backs its first token (the share of that context's continuations it won, binned by
`confidence_bin`), and the planner learns how often each bin is kept, as it learns per match
length for the row's own matches. Proposals are point masses: verification keeps the output
exactly the target's, whatever the corpus holds.

Stored as one ``.npz`` in the bundle (`CORPUS_FILE`): sorted 64-bit hashes of
the contexts with each one's most frequent next token, its count and the context's total, so
it loads in one read and a lookup is a binary search. A hash collision only makes a proposal
that verification rejects.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from specrt.bundle import CORPUS_FILE
from specrt.errors import BundleError, InvalidInputError
from specrt.runtime.lookup import NO_PROPOSAL, Proposal
from specrt.staging import current_umask

DEPTH = 4  # the longest context looked up
FORMAT = 1
_MULTIPLIER = 0x9E3779B97F4A7C15  # 2^64 / the golden ratio, odd
# The digits of pi: a seed far from any token id, so that no step mixes a zero (0 stays 0)
_SEED = 0x243F6A8885A308D3
_MASK = (1 << 64) - 1


def confidence_bin(count: int, total: int) -> int:
    """How strongly a context backs its most frequent continuation, 1 (weak) to 4: seen once,
    or the share that continuation has of the context's. On SmolLM2's held-out answers, a
    corpus of its answers to other prompts kept 0.14, 0.28, 0.43 and 0.73 of the first tokens
    in these bins (CHANGELOG.md, 2026-12-06)."""
    share = count / total
    if count >= 2 and share >= 0.8:
        return 4
    if count >= 2 and share >= 0.5:
        return 3
    if count == 1 or share >= 0.3:
        return 2
    return 1


def _hash(context: Sequence[int]) -> int:
    """The context's key: each token mixed in by a multiply and a fold of the high half into
    the low (splitmix64's mixing), from a seed of its length; as `_hashes` computes it."""
    h = _SEED + len(context)
    for token in context:
        h = ((h ^ token) * _MULTIPLIER) & _MASK
        h ^= h >> 32
    return h


def _hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """`_hash` of every n-gram of ``tokens`` ([len - n + 1], uint64; numpy's uint64
    arithmetic wraps as the masked Python ints do)."""
    count = len(tokens) - n + 1
    h = np.full(count, _SEED + n, dtype=np.uint64)
    multiplier, shift = np.uint64(_MULTIPLIER), np.uint64(32)
    for i in range(n):
        h = (h ^ tokens[i : i + count].astype(np.uint64)) * multiplier
        h ^= h >> shift
    return h


class CorpusTable:
    """The corpus's continuations (see the module). ``keys`` sorted, one entry per context."""

    def __init__(
        self,
        keys: np.ndarray,
        next_ids: np.ndarray,
        counts: np.ndarray,
        totals: np.ndarray,
        documents: int,
        tokens: int,
        depth: int = DEPTH,
    ) -> None:
        self.keys, self.next_ids, self.counts, self.totals = keys, next_ids, counts, totals
        self.documents, self.tokens, self.depth = documents, tokens, depth

    def __len__(self) -> int:
        """Contexts held."""
        return len(self.keys)

    @classmethod
    def build(cls, documents: Iterable[Sequence[int]], depth: int = DEPTH) -> CorpusTable:
        """The table of ``documents`` (token id sequences: a prompt as the model reads it and
        its answer, or any text)."""
        keys, following, docs, total = [], [], 0, 0
        for document in documents:
            ids = np.asarray(document, dtype=np.int64)
            if len(ids) < 2:
                continue
            docs, total = docs + 1, total + len(ids)
            for n in range(1, min(depth, len(ids) - 1) + 1):
                keys.append(_hashes(ids[:-1], n))  # contexts that have a next token
                following.append(ids[n:])
        if not keys:
            empty = np.zeros(0, dtype=np.uint64)
            zeros = np.zeros(0, dtype=np.uint32)
            return cls(empty, zeros.astype(np.int32), zeros, zeros, docs, total, depth)
        key, nxt = np.concatenate(keys), np.concatenate(following)
        order = np.lexsort((nxt, key))
        key, nxt = key[order], nxt[order]
        # runs of one (context, next token): their counts
        starts = np.flatnonzero(np.r_[True, (key[1:] != key[:-1]) | (nxt[1:] != nxt[:-1])])
        pair_key, pair_next = key[starts], nxt[starts]
        pair_count = np.diff(np.r_[starts, len(key)])
        # per context: the most frequent next token (the smallest id among equals), the total
        order = np.lexsort((pair_next, -pair_count, pair_key))
        pair_key, pair_next, pair_count = pair_key[order], pair_next[order], pair_count[order]
        first = np.flatnonzero(np.r_[True, pair_key[1:] != pair_key[:-1]])
        totals = np.add.reduceat(pair_count, first)
        return cls(
            pair_key[first],
            pair_next[first].astype(np.int32),
            pair_count[first].astype(np.uint32),
            totals.astype(np.uint32),
            docs,
            total,
            depth,
        )

    def propose(self, tokens: Sequence[int], k: int) -> Proposal:
        """Up to ``k`` tokens continuing ``tokens``: each the most frequent continuation of the
        longest context the corpus holds (the proposed tokens count as context)."""
        context = list(tokens[-self.depth :])
        proposed: list[int] = []
        matched = confidence = 0
        while len(proposed) < k:
            for n in range(min(self.depth, len(context)), 0, -1):
                i = self._find(_hash(context[len(context) - n :]))
                if i is not None:
                    break
            else:
                break
            if not proposed:
                matched = n
                confidence = confidence_bin(int(self.counts[i]), int(self.totals[i]))
            proposed.append(int(self.next_ids[i]))
            context = [*context, proposed[-1]][-self.depth :]
        if not proposed:
            return NO_PROPOSAL
        return Proposal(proposed, matched, "corpus", confidence=confidence)

    def token_counts(self, vocab: int) -> np.ndarray:
        """``[vocab]``: how often each token occurs with a token after it: the totals of the
        contexts of one token, found by their hashes (what a draft's reduced vocabulary is
        chosen by: `most_used`)."""
        if not len(self.keys):
            return np.zeros(vocab, dtype=np.int64)
        keys = _hashes(np.arange(vocab, dtype=np.int64), 1)
        at = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        return np.where(self.keys[at] == keys, self.totals[at], 0).astype(np.int64)

    def most_used(self, vocab: int, size: int) -> np.ndarray:
        """The ``size`` tokens the corpus uses most, sorted (among equals, the smaller ids)."""
        return np.sort(np.argsort(-self.token_counts(vocab), kind="stable")[:size])

    def _find(self, key: int) -> int | None:
        i = int(np.searchsorted(self.keys, np.uint64(key)))
        return i if i < len(self.keys) and int(self.keys[i]) == key else None

    def save(self, path: str | Path, tokenizer_sha256: str) -> None:
        """Write the table (atomically: a reader sees the old file or the new one), bound to
        the tokenizer its token ids belong to."""
        path = Path(path)
        if path.parent.exists() and not path.parent.is_dir():
            raise InvalidInputError(
                f"{path.parent} is a file where the corpus's folder goes: move it away, then "
                "run again"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=".corpus-", suffix=".npz")
        try:
            with os.fdopen(fd, "wb") as out:
                np.savez(
                    out,
                    format=np.int64(FORMAT),
                    keys=self.keys,
                    next_ids=self.next_ids,
                    counts=self.counts,
                    totals=self.totals,
                    sizes=np.array([self.documents, self.tokens, self.depth], dtype=np.int64),
                    tokenizer_sha256=np.array(tokenizer_sha256),
                )
            os.chmod(scratch, 0o666 & ~current_umask())  # mkstemp makes it 0600
            os.replace(scratch, path)
        except BaseException:
            Path(scratch).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path, tokenizer_sha256: str, vocab: int | None = None) -> CorpusTable:
        """Read a table written by `save` for the same tokenizer, its arrays checked (a table
        edited or mismatched by hand failed mid-generation: a token id past the ``vocab``, an
        array cut short)."""
        try:
            with np.load(path, allow_pickle=False) as data:
                if int(data["format"]) != FORMAT:
                    raise ValueError(f"format {int(data['format'])}")
                if str(data["tokenizer_sha256"]) != tokenizer_sha256:
                    raise BundleError(
                        f"{path} was built for another tokenizer than this bundle's; build it "
                        "again: specrt corpus --bundle DIR ..."
                    )
                documents, tokens, depth = (int(x) for x in data["sizes"])
                arrays = [data[name] for name in ("keys", "next_ids", "counts", "totals")]
            _check_arrays(*arrays, depth, vocab)
        except BundleError:
            raise
        except (OSError, ValueError, TypeError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            why = "not an .npz archive" if "allow_pickle" in str(exc) else str(exc)
            raise BundleError(
                f"{path} is not a corpus table specrt can read ({why}); build it again: "
                "specrt corpus --bundle DIR ..., or delete it"
            ) from exc
        return cls(*arrays, documents=documents, tokens=tokens, depth=depth)


def _check_arrays(keys, next_ids, counts, totals, depth: int, vocab: int | None) -> None:
    """Raise ValueError where a table's arrays are not what `build` makes."""
    arrays = {"keys": keys, "next_ids": next_ids, "counts": counts, "totals": totals}
    if any(a.ndim != 1 or len(a) != len(keys) for a in arrays.values()):
        raise ValueError("its arrays are not of one length")
    if any(a.dtype.kind not in "iu" for a in arrays.values()) or depth < 1:
        raise ValueError("its arrays are not integers, or its depth is below 1")
    if len(keys) and np.any(keys[1:] < keys[:-1]):
        raise ValueError("its contexts are not sorted")
    if len(keys) and (next_ids.min() < 0 or (vocab is not None and next_ids.max() >= vocab)):
        raise ValueError(f"it proposes token ids outside the vocabulary of {vocab}")
    if len(keys) and (counts.min() < 1 or np.any(totals < counts)):  # a share: count / total
        raise ValueError("its counts are not between 1 and their contexts' totals")


def write_corpus(bundle_dir: str | Path, documents: Iterable[Sequence[int]]) -> CorpusTable:
    """Build the table of ``documents`` (token ids of the bundle's tokenizer) and write it
    into the bundle, in place of the one it had (`specrt corpus`)."""
    from specrt.bundle import read_manifest

    root = Path(bundle_dir)
    manifest = read_manifest(root)
    table = CorpusTable.build(documents)
    if not len(table):
        raise InvalidInputError("the corpus holds no text of two tokens or more: nothing to learn")
    if table.next_ids.max() >= manifest.vocab_size or table.next_ids.min() < 0:
        raise InvalidInputError(
            f"the corpus holds token id {int(table.next_ids.max())}, outside the bundle's "
            f"vocabulary of {manifest.vocab_size}: give text made with this bundle's tokenizer"
        )
    table.save(root / CORPUS_FILE, manifest.tokenizer.sha256)
    return table

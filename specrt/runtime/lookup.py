"""Proposals without a draft model: continuations found by matching the newest tokens against
text already seen. Both propose point masses (`verification` accepts such a token x with
probability p(x)), at the cost of a dictionary lookup per token instead of a model call.

* `NgramIndex`: prompt lookup (transformers' ``prompt_lookup_num_tokens``, vLLM's n-gram
  proposer): the longest n-gram (``min_n`` .. ``max_n``) ending the row that occurred earlier
  in the row's own prompt and output; proposes what followed its latest occurrence.
* `SuffixCache`: shared by the requests of one process (SuffixDecoding's global tree): counts
  of the token that followed every n-gram of earlier prompts and outputs; proposes the most
  frequent continuation, token by token. Its memory is bounded by the tokens it keeps: the
  oldest document is forgotten first.
"""

from __future__ import annotations

import numbers
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specrt.errors import InvalidInputError
from specrt.validation import integer

DEFAULT_MIN_NGRAM = 1
DEFAULT_MAX_NGRAM = 3
SUFFIX_DEPTH = 4  # the longest context the suffix cache matches
DEFAULT_SUFFIX_TOKENS = 1 << 16  # tokens the suffix cache keeps (about 60 MB at most)


@dataclass
class Proposal:
    """Tokens proposed, the length of the match they came from (0: none), by whom, and
    whether they continue the row's own output."""

    tokens: list[int]
    match: int
    source: str = ""
    # From text the row generated (not its prompt, not another request's): a row repeating
    # itself goes on far more often than it follows its prompt (docs/performance.md,
    # "Proposers"; CHANGELOG.md, 2026-12-02).
    from_output: bool = False
    # A corpus's backing of its first token (`corpus.confidence_bin`, 1-4; 0: not a corpus's):
    # what its acceptance is learnt by, where a match's is learnt by its length.
    confidence: int = 0

    def first(self, n: int) -> Proposal:
        """The first ``n`` of its tokens, from the same match."""
        return Proposal(self.tokens[:n], self.match, self.source, self.from_output, self.confidence)


NO_PROPOSAL = Proposal([], 0)


class NgramIndex:
    """One row's n-grams, each with the position after its latest occurrence. The row's token
    list only grows (rolled-back tokens never entered it), so the index is updated with the
    new tokens only."""

    def __init__(self, min_n: int = DEFAULT_MIN_NGRAM, max_n: int = DEFAULT_MAX_NGRAM) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, not {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        # The bundle's corpus (`specrt.runtime.corpus`), looked up where nothing else matches
        self.corpus = None
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it
        self._seen = 0  # tokens[:_seen] are indexed (each with its continuation)
        # Where the row's own output starts (its prompt's length); None: the row's length at
        # its first lookup, which the one-row loop makes with the prompt alone
        self.prompt_length: int | None = None

    def reset(self) -> None:
        self._next.clear()
        self._seen = 0
        self.prompt_length = None

    def propose(self, tokens: Sequence[int], k: int) -> Proposal:
        """Up to ``k`` tokens continuing ``tokens`` (the same list, grown, at every call)."""
        self._index(tokens)
        if self.prompt_length is None:
            self.prompt_length = len(tokens)
        if k <= 0:
            return NO_PROPOSAL
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = self._next.get(tuple(tokens[end - n :]))
            if start is not None:
                own = start >= self.prompt_length
                return Proposal(_continued(tokens, start, k), n, "lookup", own)
        return NO_PROPOSAL

    def _index(self, tokens: Sequence[int]) -> None:
        # The n-gram ending at position j is indexed once token j+1 (its continuation) exists,
        # so the row's own last n-gram never matches itself. Each size in one pass, in order
        # of j (the latest occurrence wins): a whole prompt is indexed at a row's first round.
        end = len(tokens) - 1
        for n in range(self.min_n, self.max_n + 1):
            first = max(self._seen, n - 1)  # j: from here to end - 1
            if first < end:
                grams = zip(*(tokens[first - n + 1 + i : end - n + 1 + i] for i in range(n)))
                self._next.update(zip(grams, range(first + 1, end + 1)))
        self._seen = max(self._seen, end)


def find_match(
    index: NgramIndex,
    suffix: SuffixCache | None,
    tokens: Sequence[int],
    k: int,
    use_corpus: bool = True,
) -> Proposal:
    """Up to ``k`` tokens: the row's own match, else the suffix cache's (where there is one);
    the bundle's corpus's (``use_corpus``) where neither matched, or only the row's last
    token did."""
    found = index.propose(tokens, k)
    if not found.tokens and suffix is not None and k > 0:
        found = suffix.propose(tokens, k)
    # One token matched in the row's own text is weak evidence: on SmolLM2's held-out answers
    # such a match's next token was the target's 0.11-0.15 of the time, a corpus's 0.29
    # (CHANGELOG.md, 2026-12-06).
    weak = not found.tokens or (found.source == "lookup" and found.match < 2)
    if weak and use_corpus and index.corpus is not None and k > 0:
        retrieved = index.corpus.propose(tokens, k)
        found = retrieved if retrieved.tokens else found
    return found


def _continued(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """``k`` tokens from ``start``; past the end, the proposal repeats itself: the row is
    taken to continue the loop it is in (a match near the end has a short period)."""
    proposed = list(tokens[start : start + k])
    period = len(tokens) - start
    while len(proposed) < k:
        proposed.append(proposed[len(proposed) - period])
    return proposed


class SuffixCache:
    """Continuations learned from earlier documents (prompts and outputs) of this process.

    ``max_tokens`` bounds what is kept: adding a document past it forgets the oldest ones
    (their counts are taken back out). Shared across requests, so a service turns it on only
    where requests may see each other's text."""

    def __init__(
        self,
        max_tokens: int = DEFAULT_SUFFIX_TOKENS,
        depth: int = SUFFIX_DEPTH,
        min_n: int = DEFAULT_MIN_NGRAM,
    ) -> None:
        max_tokens = integer("max_tokens", max_tokens, 1)
        depth = integer("depth", depth, 1)
        min_n = integer("min_n", min_n, 1, depth, f"use an integer in [1, depth] ({depth} here)")
        self.max_tokens, self.depth, self.min_n = max_tokens, depth, min_n
        self._counts: dict[tuple[int, ...], dict[int, int]] = {}
        self._documents: deque[tuple[int, ...]] = deque()
        self.tokens = 0  # kept now
        self.documents_added = 0

    def __len__(self) -> int:
        """Contexts indexed."""
        return len(self._counts)

    def add(self, document: Sequence[int]) -> None:
        """Learn a document (a prompt and its output); forget the oldest past ``max_tokens``."""
        if isinstance(document, np.ndarray) and document.ndim == 1:
            document = document.tolist()
        if (
            not isinstance(document, Sequence)
            or isinstance(document, (str, bytes))
            or not all(_token_id(t) for t in document)
        ):
            raise InvalidInputError(
                f"a suffix cache learns a list of token ids (integers >= 0), not {document!r:.60}"
            )
        document = tuple(int(t) for t in document[-self.max_tokens :])
        if len(document) < 2:
            return
        self._count(document, +1)
        self._documents.append(document)
        self.tokens += len(document)
        self.documents_added += 1
        while self.tokens > self.max_tokens:
            old = self._documents.popleft()
            self._count(old, -1)
            self.tokens -= len(old)

    def _count(self, document: tuple[int, ...], sign: int) -> None:
        counts = self._counts
        for j in range(len(document) - 1):
            following = document[j + 1]
            for n in range(1, min(self.depth, j + 1) + 1):
                key = document[j - n + 1 : j + 1]
                if sign > 0:
                    seen = counts.setdefault(key, {})
                    seen[following] = seen.get(following, 0) + 1
                    continue
                seen = counts[key]
                seen[following] -= 1
                if not seen[following]:
                    del seen[following]
                    if not seen:
                        del counts[key]

    def propose(self, tokens: Sequence[int], k: int) -> Proposal:
        """Up to ``k`` tokens: each the most frequent one after the longest known context."""
        context = list(tokens[-self.depth :])
        proposed: list[int] = []
        first_match = 0
        while len(proposed) < k:
            for n in range(min(self.depth, len(context)), self.min_n - 1, -1):
                seen = self._counts.get(tuple(context[len(context) - n :]))
                if seen:
                    break
            else:
                break
            token = max(seen, key=seen.__getitem__)
            first_match = first_match or n
            proposed.append(token)
            context = [*context[1:], token] if len(context) >= self.depth else [*context, token]
        return Proposal(proposed, first_match, "suffix") if proposed else NO_PROPOSAL

    def memory_bytes(self) -> int:
        """What the index holds, by `sys.getsizeof` (keys, count tables, documents)."""
        size = sys.getsizeof(self._counts) + sys.getsizeof(self._documents)
        for key, seen in self._counts.items():
            size += sys.getsizeof(key) + sys.getsizeof(seen)
        return size + sum(sys.getsizeof(document) for document in self._documents)


def _token_id(token: object) -> bool:
    return isinstance(token, numbers.Integral) and not isinstance(token, bool) and token >= 0

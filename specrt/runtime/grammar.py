"""Structured output (`specrt.structured.StructuredOutput`) in the loop.

The grammar is one more logits processor (`specrt.runtime.processors`): at each position the
tokens it does not allow get -inf, as if the tokens before had been generated. A verification
pass masks each of its positions after the proposal before it, the draft drafts under the same
masks, and the rejection sampler compares against the masked distribution, so the output is
the target's under the grammar, exactly, speculative or not. The masks come from llguidance
(Microsoft's, one of vLLM's backends), which reads the bundle's tokenizer.json.
"""

from __future__ import annotations

import functools
import json
import re

import numpy as np

from specrt.errors import GrammarDeadEnd, InvalidInputError
from specrt.structured import FIELD, llguidance_module


class GrammarState:
    """One row's grammar: a matcher that has consumed the row's new tokens (it follows the
    row's tokens as each call gives them, rounds rolled back included), and the masks of the
    positions after them."""

    def __init__(self, matcher, vocab: int) -> None:
        self._matcher = matcher
        self._seen: list[int] = []
        self._words = (vocab + 31) // 32
        self._bits = np.full((1, self._words), -1, dtype=np.int32)

    def _follow(self, generated: list[int]) -> bool:
        """Bring the matcher to ``generated``; False where a token of it breaks the grammar
        (past a dead end the masks let through), which the matcher then stops before."""
        same = len(self._seen)
        if generated[:same] != self._seen:  # rolled back (else: one comparison, not a loop)
            same = next((i for i, (a, b) in enumerate(zip(self._seen, generated)) if a != b),
                        min(same, len(generated)))  # fmt: skip
        if same < len(self._seen):
            self._matcher.rollback(len(self._seen) - same)
        whole = True
        for token in generated[same:]:
            if self._matcher.is_stopped():  # complete: EOS after it is not held, nor counted
                break
            if not self._matcher.try_consume_tokens([token]):
                whole = False
                break
            same += 1
        self._seen = generated[:same]
        return whole

    def valid_prefix(self, generated: list[int], proposal: list[int]) -> int:
        """How many of ``proposal``'s first tokens the grammar allows after ``generated``."""
        if not self._follow(generated):
            return 0
        return self._matcher.validate_tokens(proposal)

    def forced(self, generated: list[int]) -> list[int]:
        """The tokens the grammar allows alone after ``generated`` (a JSON schema's keys and
        punctuation): the target takes them with probability 1, so they are drafts that are
        always kept."""
        if not self._follow(generated) or self._matcher.is_stopped():
            return []
        return self._matcher.compute_ff_tokens()

    def apply(
        self, logits: np.ndarray, generated: list[int], proposal: list[int], draft: bool = False
    ) -> None:
        """``logits [m, W]`` masked in place: row j as after ``generated`` and
        ``proposal[:j]``. Rows past a proposed token the grammar refuses stay as they are (that
        token is rejected before them), and so does a row after a proposal where nothing the
        grammar allows is among the W columns. A ``draft``'s rows stay so too where its own
        tokens lead there (a reduced vocabulary: its proposal is then rejected); the target's
        first row raises `GrammarDeadEnd` (the row fails, as the target alone's would)."""
        if not self._follow(generated):
            if draft:
                return
            raise GrammarDeadEnd(self._dead_end(generated))
        rows = len(logits)
        if len(self._bits) < rows:
            self._bits = np.empty((rows, self._words), dtype=np.int32)
        bits = self._bits[:rows]
        bits.fill(-1)
        size = bits.shape[1] * 4
        if rows == 1:
            self._matcher.unsafe_compute_mask_ptr(bits.ctypes.data, size)
        else:  # each position after the proposal before it, in one call
            drafts = [(self._matcher, 0, list(proposal[: rows - 1]))]
            _executor().unsafe_compute_mask_ptr_with_draft_token(
                drafts, bits.ctypes.data, size, rows
            )
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        width = logits.shape[1]
        allowed = allowed[:, :width].astype(bool)
        if allowed.shape[1] < width:  # columns past the tokenizer's vocabulary
            allowed = np.pad(allowed, ((0, 0), (0, width - allowed.shape[1])))
        for j, (row, keep) in enumerate(zip(logits, allowed)):
            if keep.any():
                row[~keep] = -np.inf
            elif j == 0 and not draft:
                raise GrammarDeadEnd(self._dead_end(generated))

    def _dead_end(self, generated: list[int]) -> str:
        return (
            f"the structured output cannot go on after {len(generated)} new token(s): no token "
            "of this model's vocabulary continues it (does the vocabulary write every "
            "character the grammar needs?)"
        )


_EXECUTOR = None


def _executor():
    """One llguidance executor of one thread: the masks are small, and a pool of its own would
    fight onnxruntime's for the host's cores."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance_module().LLExecutor(num_threads=1)
    return _EXECUTOR


def guidance_tokenizer(tokenizer, eos_token_ids: tuple[int, ...], vocab: int):
    """llguidance's tokenizer for a `tokenizers.Tokenizer`: read from its JSON where llguidance
    knows its decoder (byte-level BPE; SentencePiece's byte fallback), else from each token's
    bytes as a Metaspace decoder writes them ("▁" a space, "<0xAB>" a byte)."""
    llguidance = llguidance_module()
    try:
        return llguidance.LLTokenizer(
            tokenizer.to_str(), n_vocab=vocab, eos_token=list(eos_token_ids)
        )
    except ValueError:  # "can't determine decoder type"
        pass
    try:
        wrapper = llguidance.TokenizerWrapper(_Pieces(tokenizer, eos_token_ids[0]))
        return llguidance.LLTokenizer(wrapper, n_vocab=vocab, eos_token=list(eos_token_ids))
    except (ValueError, RuntimeError) as exc:
        message = f"structured output cannot read this bundle's tokenizer ({exc})"
        raise InvalidInputError(message, FIELD) from None


class _Pieces:
    """What llguidance's `TokenizerWrapper` reads of a tokenizer: each token's bytes, the
    special tokens, and how a string encodes."""

    def __init__(self, tokenizer, eos_token_id: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id, self.bos_token_id = eos_token_id, None
        added = tokenizer.get_added_tokens_decoder()
        self.special_token_ids = [i for i, token in added.items() if token.special]
        count = tokenizer.get_vocab_size(with_added_tokens=True)
        self.tokens = [
            self._bytes(tokenizer.id_to_token(i) or "", i in added) for i in range(count)
        ]

    @staticmethod
    def _bytes(piece: str, added: bool) -> bytes:
        if not added and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes([int(piece[3:5], 16)])
        return piece.encode() if added else piece.replace("\u2581", " ").encode()

    def __call__(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _plain(self):
        """The tokenizer without the space a Metaspace pre-tokenizer puts before a text:
        llguidance tokenizes pieces of the answer, which must keep their bytes."""
        from tokenizers import Tokenizer

        spec = json.loads(self._tokenizer.to_str())

        def never(node):
            if isinstance(node, dict):
                if node.get("type") == "Metaspace":
                    node["prepend_scheme"] = "never"
                for value in node.values():
                    never(value)
            elif isinstance(node, list):
                for value in node:
                    never(value)

        never(spec.get("pre_tokenizer"))
        return Tokenizer.from_str(json.dumps(spec))


def row_grammar(config, tokenizer, eos_token_ids, vocab: int) -> GrammarState | None:
    """A fresh `GrammarState` for one row of ``config`` (None where it asks for no structured
    output) in a bundle whose tokenizer is ``tokenizer`` (a `BundleTokenizer`: callers check
    there is one first), ending with its EOS."""
    if config.structured_output is None:
        return None
    guidance = tokenizer.guidance(tuple(sorted(eos_token_ids)), vocab)
    matcher = llguidance_module().LLMatcher(guidance, config.structured_output.spec, log_level=0)
    if matcher.is_error():
        message = f"the structured output does not compile: {matcher.get_error()}"
        raise InvalidInputError(message, FIELD)
    return GrammarState(matcher, vocab)

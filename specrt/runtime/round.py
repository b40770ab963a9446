"""The round engine: one speculative round over rows sharing every model call (a lone request
is a batch of one), and the pass that gives each admitted row its first token.

A round, for rows in slots ``start .. start + n - 1`` of both models' caches:

1. **Draft.** K steps of the draft model, each ONE call for every row; a row that verifies a
   match (prompt lookup, the suffix cache) instead, or fewer tokens, draws nothing past its
   share. A lone row's schedule may stop the steps early (``keep_drafting``).
2. **Verify.** ONE target call over ``[last token, proposal]`` of every row: ``[n, W+1]``
   positions, W the widest proposal.
3. **Accept.** Each row keeps a prefix of its proposal and the token after it
   (`verification.verify`: greedy, rejection sampling, or a seeded row's keyed draws).

Rolling the caches back to what stands, and choosing each row's share, are the caller's
(`batching.BatchRunner`, `planning`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from specrt.backends import NEED_ARGMAX, NEED_LOGITS, Forward, RowsDecoder
from specrt.backends.base import PREFILL_CHUNK
from specrt.errors import GrammarDeadEnd, NumericalError
from specrt.runtime.config import SamplingParams
from specrt.runtime.logprobs import TokenLogprob, token_logprobs
from specrt.runtime.processors import LogitsProcessors
from specrt.runtime.sampling import (
    LOOP_DTYPE,
    Draws,
    check_probabilities,
    draw,
    greedy_tokens,
    top_probability,
    warp,
)
from specrt.runtime.schedules import KeepGoing
from specrt.runtime.verification import accept_greedy, verify


@dataclass
class RoundResult:
    drafted: int  # proposed tokens the target checked
    accepted: int  # of them kept by the target
    tokens: list[int]  # emitted: the accepted proposal, then the recovered or bonus token
    draft_time_s: float
    verify_time_s: float
    source: str = "model"  # the proposer of the draft tokens
    error: str | None = None  # why this row failed (NaN/inf logits)
    logprobs: list[TokenLogprob] | None = None  # of ``tokens``, where the row asks for them


@dataclass
class RowRound:
    """One row's part in a round: its tokens (the target's cache holds all but the newest),
    how to sample, its own random stream, and how many proposed tokens it verifies: the first
    ``k`` of the draft model's (fewer near its length limit), or ``match``, tokens proposed by
    matching (point masses) in their place. ``offset``: the row's first tokens the draft's
    cache leaves out (it reads a window of a long row)."""

    tokens: list[int]
    sampling: SamplingParams
    rng: Draws
    k: int
    match: list[int] | None = None
    source: str = "model"
    offset: int = 0
    logprobs: int | None = None  # most likely tokens to list at each new token's position
    processors: LogitsProcessors | None = None  # the bias and penalties, where it asks
    prompt_length: int = 0  # of ``tokens`` (the penalties count the output's tokens)
    # The draft's distributions ``[K, V]``, reused round after round: a fresh array each round
    # is large enough to come from mmap, and its page faults cost more than a draft step.
    q_buffer: np.ndarray | None = field(default=None, repr=False)

    @property
    def model_k(self) -> int:
        """Draft-model tokens this row uses (and draws for)."""
        return 0 if self.match else self.k

    def q_rows(self, k: int, vocab: int) -> np.ndarray:
        """``[k, vocab]`` rows for this round's draft distributions."""
        if self.q_buffer is None or len(self.q_buffer) < k or self.q_buffer.shape[1] != vocab:
            self.q_buffer = np.empty((k, vocab), LOOP_DTYPE)
        return self.q_buffer[:k]


def run_round(
    target: RowsDecoder,
    draft: RowsDecoder,
    rows: list[RowRound],
    k: int,
    start: int = 0,
    keep_drafting: KeepGoing | None = None,
) -> list[RoundResult]:
    """One round for ``rows`` (slots ``start ..``): K draft steps (none when every row has a
    match), ONE target call, each row's accepted prefix. ``keep_drafting``: a lone row's
    schedule, asked after each draft step (see `draft_rows`). A row whose logits come out
    NaN/inf fails alone (its result's ``error``); the others go on as they would have."""
    started = time.perf_counter()
    n = len(rows)
    failed: dict[int, str] = {}

    # 1. Draft: drafts [n, K] (filler past a row's share), q[i] [K, V] for sampled rows
    k = k if any(row.model_k for row in rows) else 0
    drafts, q = draft_rows(draft, rows, k, failed, start, keep_drafting)
    proposals = [row.match or own[: row.k] for row, own in zip(rows, drafts.tolist())]
    drafted_at = time.perf_counter()

    # 2. Verify: ids [n, W+1] = each row's newest token, its proposal, then filler
    width = max(row.k for row in rows)
    ids = np.zeros((n, width + 1), dtype=np.int64)
    for i, (row, proposal) in enumerate(zip(rows, proposals)):
        ids[i, 0] = row.tokens[-1]
        ids[i, 1 : 1 + row.k] = proposal
    greedy = all(row.sampling.greedy for row in rows)
    logits = not greedy or any(_reads_logits(row) for row in rows)
    need = NEED_LOGITS if logits else NEED_ARGMAX  # what a device backend brings back
    out = target.forward_rows(ids, keep_last=width + 1, start=start, need=need)
    scores, raw = _processed(out, rows, proposals, failed)  # what the target chooses by

    # 3. Accept: (accepted, next token) per row; greedy rows in one argmax over the batch
    verdicts: list[tuple[int, int]] = []
    if greedy and not failed:
        try:
            choices = greedy_tokens(_flat(scores), "target")  # [n * (W+1)]
            stride = width + 1
            verdicts = [
                accept_greedy(proposals[i], choices[i * stride : (i + 1) * stride])
                for i in range(n)
            ]
        except NumericalError:
            verdicts = []  # find the row(s) below
    if not verdicts:
        for i, row in enumerate(rows):
            row_out = _own(row, _pick(scores, (i, slice(0, row.k + 1))))  # [k+1, V]
            row_q = q[i][: row.k] if q[i] is not None and not row.match else None
            args = proposals[i], row_q, row_out, row.sampling, row.rng, len(row.tokens)
            verdicts.append((0, 0) if i in failed else _row_verdict(failed, i, *args))
    verify_time = time.perf_counter() - drafted_at
    results = []
    for i, (row, (accepted, token)) in enumerate(zip(rows, verdicts)):
        tokens = [] if i in failed else [*proposals[i][:accepted], token]
        result = RoundResult(
            row.k, accepted, tokens, drafted_at - started, verify_time,
            row.source if row.match else "model", failed.get(i),
        )  # fmt: skip
        if row.logprobs is not None and tokens:  # position j's logits chose token j
            logits = raw.get(i, out.logits[i])
            result.logprobs = token_logprobs(logits, tokens, row.logprobs)
        results.append(result)
    return results


def _reads_logits(row: RowRound) -> bool:
    """Whether a greedy row needs the target's logits, not its argmax alone."""
    return row.logprobs is not None or row.processors is not None


def _processed(
    out: Forward, rows: list[RowRound], proposals: list[list[int]], failed: dict[int, str]
) -> tuple[Forward, dict[int, np.ndarray]]:
    """The target's pass with each row's logits processors applied at its positions (its
    proposal before each counted as generated), in place, and the raw logits of processed
    rows that list log-probabilities; ``out`` itself where no row has any. A row whose
    structured output has no way on fails alone (in ``failed``)."""
    if all(row.processors is None for row in rows):
        return out, {}
    raw = {}
    for i, row in enumerate(rows):
        if row.processors is not None:
            kept = out.logits[i, : len(proposals[i]) + 1]
            if row.logprobs is not None:
                raw[i] = kept.copy()
            try:
                row.processors.apply(kept, row.tokens, row.prompt_length, proposals[i])
            except GrammarDeadEnd as exc:
                failed[i] = str(exc)
    # not ``out``: a backend's own argmax is the raw logits'; the softmax: the other rows'
    return Forward(out.logits, out.probabilities), raw


def _own(row: RowRound, picked: Forward) -> Forward:
    """A row's part of a `_processed` pass: without the graph's softmax where the row's logits
    were processed (it is the unprocessed one), so the row's sampling warps its own; rows
    without processors keep it, and sample as they would in any other call."""
    if row.processors is None or picked.probabilities is None:
        return picked
    return Forward(picked.logits)


def first_tokens(target: RowsDecoder, rows: list[RowRound], start: int = 0) -> list[RoundResult]:
    """Each row's first token after its prompt (rows in slots ``start ..``): one call per row
    feeds what the target's cache lacks of the prompt (its end: at most a prefill chunk) and
    the row's ``match`` if it has one (verified in the same pass: no model runs for it), and
    reads the last positions. A call of one row attends over that row's positions only; one
    over several rows would attend over the whole cache, which rows already running may have
    grown far past these prompts.

    Rows with one prompt (and no match) read it once: the first of them reads it, the others
    copy its cache and draw their own token from its logits, the very values their own pass
    would have computed (``n`` samples of a prompt, a law's thousands of rows)."""
    results: list[RoundResult | None] = [None] * len(rows)
    alike: dict[object, list[int]] = {}
    for i, row in enumerate(rows):
        alike.setdefault(i if row.match else tuple(row.tokens), []).append(i)
    for members in alike.values():
        # all at once: a later call may write where this one's arrays are (kept arrays)
        first, out = start + members[0], None
        for i in members:
            row, started = rows[i], time.perf_counter()
            if out is None:
                match = row.match or []
                unread = row.tokens[int(target.lengths[first]) :]
                ids = np.array([unread + match], dtype=np.int64)  # [1, unread + M]
                greedy = all(rows[j].sampling.greedy for j in members)
                logits = not greedy or any(_reads_logits(rows[j]) for j in members)
                need = NEED_LOGITS if logits else NEED_ARGMAX
                out = target.forward_rows(ids, keep_last=len(match) + 1, start=first, need=need)
            else:
                target.copy_row(first, start + i)
            results[i] = _first_verdict(row, out, started)
    return results


def read_prompt(
    target: RowsDecoder, slot: int, prompt: list[int], top: int
) -> list[TokenLogprob | None]:
    """Feed ``prompt`` but its last token to ``target``'s row ``slot`` (empty), a chunk a call
    with every position's logits kept, and return each prompt token's entry (None for the
    first, which nothing predicts); the pass over the last token gives the first new one."""
    entries: list[TokenLogprob | None] = [None]
    body = prompt[:-1]
    for offset in range(0, len(body), PREFILL_CHUNK):
        chunk = body[offset : offset + PREFILL_CHUNK]
        ids = np.array([chunk], dtype=np.int64)
        out = target.forward_rows(ids, keep_last=len(chunk), start=slot, need=NEED_LOGITS)
        entries += token_logprobs(out.logits[0], prompt[offset + 1 : offset + 1 + len(chunk)], top)
    return entries


def _first_verdict(row: RowRound, out: Forward, started: float) -> RoundResult:
    """A row's first token from the pass over its prompt (and match): ``out [1, M + 1, ...]``."""
    failed: dict[int, str] = {}
    match = row.match or []
    picked = _pick(out, 0)
    if row.processors is not None:  # on a copy: rows of one prompt share ``out``
        logits = np.array(picked.logits, dtype=np.float32)
        try:
            picked = Forward(row.processors.apply(logits, row.tokens, row.prompt_length, match))
        except GrammarDeadEnd as exc:
            failed[0] = str(exc)
    args = match, None, picked, row.sampling, row.rng, len(row.tokens)
    accepted, token = (0, 0) if failed else _row_verdict(failed, 0, *args)
    seconds = time.perf_counter() - started
    tokens = [] if failed else [*match[:accepted], token]
    source = row.source if match else "model"
    result = RoundResult(len(match), accepted, tokens, 0.0, seconds, source, failed.get(0))
    if row.logprobs is not None and tokens:
        result.logprobs = token_logprobs(out.logits[0], tokens, row.logprobs)
    return result


def _row_verdict(failed: dict[int, str], i: int, *verify_args) -> tuple[int, int]:
    """`verify` for row ``i``; NaN/inf logits fail that row alone (recorded in ``failed``)."""
    try:
        return verify(*verify_args)
    except NumericalError as exc:
        failed[i] = str(exc)
        return 0, 0


def draft_rows(
    draft: RowsDecoder,
    rows: list[RowRound],
    k: int,
    failed: dict[int, str] | None = None,
    start: int = 0,
    keep_drafting: KeepGoing | None = None,
) -> tuple[np.ndarray, list[np.ndarray | None]]:
    """K draft tokens for every row ``[n, K]`` (rows in slots ``start ..``) and, per sampled
    row, the distributions they were drawn from ``[K, V]``. The first call feeds each row what
    it has not yet seen (1 token, or 2 after a fully accepted round), right-padded to the
    longest (`catch_up` first when the draft is further behind). A row whose draft logits are
    NaN/inf is recorded in ``failed`` (its drafts are filler) instead of failing the others.
    ``keep_drafting`` (one row only): asked after each token with the draft's confidence in it
    (its probability: the top one when greedy); False stops drafting, and the row verifies
    what was drafted so far."""
    failed = {} if failed is None else failed
    n = len(rows)
    drafts = np.zeros((n, k), dtype=np.int64)
    if not k:
        return drafts, [None] * n
    vocab = draft.vocab_size
    q = [None if row.sampling.greedy else row.q_rows(k, vocab) for row in rows]
    lengths = draft.lengths[start : start + n].tolist()
    unseen = [row.tokens[row.offset + length :] for row, length in zip(rows, lengths)]
    ids, real = _right_padded(unseen)  # [n, width], [n]
    width = ids.shape[1]
    ragged = bool((real != width).any())
    newest = (np.arange(n), real - 1)  # each row's newest real token, in a ragged first call
    greedy = all(row.sampling.greedy for row in rows)
    processed = any(row.processors is not None for row in rows)
    need = NEED_ARGMAX if greedy and not processed else NEED_LOGITS
    for step in range(k):
        if step == 0 and ragged:
            out = draft.forward_rows(ids, keep_last=width, fed=real, start=start, need=need)
            picked = _pick(out, newest)  # [n, V]
        else:
            newest_ids = ids if step == 0 else drafts[:, step - 1 : step]  # [n, 1 or width]
            out = draft.forward_rows(newest_ids, keep_last=1, start=start, need=need)
            picked = _pick(out, (slice(None), 0))  # [n, V]
        if processed:  # drafting as the target will choose: more of it kept
            picked = _draft_processed(picked, rows, drafts[:, :step])
        if greedy and not failed:
            try:
                drafts[:, step] = greedy_tokens(picked, "draft")
            except NumericalError:
                _draft_each(rows, step, picked, q, drafts, failed)  # find the row(s)
        else:
            _draft_each(rows, step, picked, q, drafts, failed)
        if keep_drafting is not None and not failed:
            confidence = _confidence(rows[0], picked, q[0], step, int(drafts[0, step]))
            if not keep_drafting(step + 1, confidence):
                rows[0].k = min(rows[0].k, step + 1)
                return drafts[:, : step + 1], q
    return drafts, q


def _draft_processed(picked: Forward, rows: list[RowRound], drafted: np.ndarray) -> Forward:
    """A draft step's logits ``[n, V]`` with each row's logits processors applied, as after
    its tokens and its drafts so far ``drafted [n, step]``."""
    for i, row in enumerate(rows):  # in place: the step's own arrays
        if row.processors is not None:
            before = [*row.tokens, *drafted[i].tolist()]
            row.processors.apply(picked.logits[i : i + 1], before, row.prompt_length, [], True)
    return Forward(picked.logits)  # (the graph's softmax is the unprocessed one)


def _draft_each(rows, step: int, picked: Forward, q, drafts: np.ndarray, failed) -> None:
    """Each row's draft token at ``step``, drawn by its own rules (filler past its share)."""
    for i, row in enumerate(rows):
        if step >= row.model_k or i in failed:  # past this row's share: filler, no draw
            drafts[i, step] = drafts[i, step - 1] if step else 0
            continue
        try:
            drafts[i, step] = _draft_token(row, i, step, picked, q)
        except NumericalError as exc:
            failed[i] = str(exc)


def _draft_token(row: RowRound, i: int, step: int, picked: Forward, q) -> int:
    """Row ``i``'s draft token at ``step`` (sampled rows: its distribution into ``q[i]``)."""
    s = row.sampling
    if s.greedy:
        [token] = greedy_tokens(_pick(picked, slice(i, i + 1)), "draft")
        return token
    logits, probabilities = picked.logits, picked.probabilities
    if probabilities is not None and s.identity_warp:
        q[i][step] = probabilities[i]
        check_probabilities(q[i][step], logits[i], "draft")
    else:
        q[i][step] = warp(logits[i], s.temperature, s.top_k, s.top_p, "draft", LOOP_DTYPE, s.min_p)
    return draw(q[i][step], row.rng, len(row.tokens) + step)


def _confidence(row: RowRound, picked: Forward, q: np.ndarray | None, step: int, token: int):
    """The draft's probability of the token it drafted for the first row: the one drawn from
    (sampled), or its top one (greedy), where the backend computed it if it did."""
    if q is not None:
        return float(q[step, token])
    if picked.max_probability is not None:
        return float(picked.max_probability[0])
    if picked.probabilities is not None:
        return float(picked.probabilities[0, token])
    return top_probability(picked.logits[0], token)


def _pick(out: Forward, index) -> Forward:
    """What a rows call brought back (``[n, kept, V]`` arrays, or a device backend's argmax
    ``[n, kept]``), at ``index`` of its rows and positions."""
    if out.argmax is None:  # a host backend's arrays
        probabilities = out.probabilities
        return Forward(out.logits[index], None if probabilities is None else probabilities[index])
    top_p = None if out.max_probability is None else out.max_probability[index]
    argmax = np.asarray(out.argmax)[index].tolist()
    return Forward(None, None, argmax, out.max_logit[index], top_p)


def _flat(out: Forward) -> Forward:
    """A rows call's output with its rows and positions as one list of rows."""
    if out.argmax is None:
        return Forward(out.logits.reshape(-1, out.logits.shape[-1]))
    return Forward(
        None,
        argmax=np.asarray(out.argmax).reshape(-1).tolist(),
        max_logit=out.max_logit.reshape(-1),
    )


def catch_up(draft: RowsDecoder, rows: list[RowRound], start: int = 0) -> int:
    """Feed the draft all but the newest of the tokens it has not seen, where it is more than
    ``draft.catch_up_above`` behind (after rounds without drafting, or a prompt it skipped), so
    that a round's first draft call feeds each row a few tokens (rows in slots ``start ..``);
    the tokens fed.
    Rows far behind are fed apart from the others (`prefill_rows`)."""
    lengths = draft.lengths[start : start + len(rows)].tolist()
    unseen = [row.tokens[row.offset + length : -1] for row, length in zip(rows, lengths)]
    if max(map(len, unseen)) <= draft.catch_up_above:
        return 0
    draft.prefill_rows(start, unseen)
    return sum(map(len, unseen))


def _right_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """``[n, longest]`` token ids, each row's padded at its end, and how many are real."""
    real = np.array([len(tokens) for tokens in rows], dtype=np.int64)
    ids = np.zeros((len(rows), max(1, int(real.max()))), dtype=np.int64)
    for i, tokens in enumerate(rows):
        ids[i, : len(tokens)] = tokens
    return ids, real

"""One speculative round: draft K tokens, verify them in ONE target pass, accept a prefix.

The math of which tokens stand is in `verification.py`; rolling the caches back and stopping are
the caller's (`generator.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from specrt.backends import NEED_ARGMAX, NEED_LOGITS, Decoder, Forward, RowsDecoder
from specrt.errors import NumericalError
from specrt.runtime.config import SamplingParams
from specrt.runtime.drafters import Drafter
from specrt.runtime.sampling import (
    LOOP_DTYPE,
    Draws,
    check_probabilities,
    draw,
    greedy_tokens,
    rows_needed,
    warp,
)
from specrt.runtime.schedules import DraftSchedule, KeepGoing
from specrt.runtime.verification import accept_greedy, verify


@dataclass
class RoundResult:
    drafted: int  # draft tokens proposed
    accepted: int  # of them kept by the target
    tokens: list[int]  # emitted: the accepted draft tokens, then the recovered or bonus token
    draft_time_s: float
    verify_time_s: float
    source: str = "model"  # the proposer of the draft tokens
    error: str | None = None  # batched rounds: why this row failed (NaN/inf logits)


def speculative_round(
    target: Decoder,
    drafter: Drafter,
    tokens: list[int],
    k: int,
    sampling: SamplingParams,
    rng: Draws,
    keep_drafting: KeepGoing | None = None,
    limit: int | None = None,
) -> RoundResult:
    """Continue ``tokens`` by one round: at most ``k`` draft tokens (``keep_drafting`` may stop
    the drafter earlier; a matching proposer may take up to ``limit``), all of them checked by
    one target pass. k = 0 (and nothing matched) is a plain target step.

    The target's cache holds all of ``tokens`` but the newest (the caller rolls it back so); it
    is fed that token and the draft, K+1 positions, and returns what verification reads of
    them (`sampling.rows_needed`)."""
    started = time.perf_counter()
    draft = drafter.propose(tokens, k, sampling, rng, keep_drafting, limit)
    drafted_at = time.perf_counter()

    fed = tokens[target.length :] + draft.tokens
    out = target.forward(fed, keep_last=len(draft.tokens) + 1, need=rows_needed(sampling))
    accepted, next_token = verify(
        draft.tokens, draft.probabilities, out, sampling, rng, len(tokens)
    )
    return RoundResult(
        drafted=len(draft.tokens),
        accepted=accepted,
        tokens=[*draft.tokens[:accepted], next_token],
        draft_time_s=drafted_at - started - draft.catch_up_s,
        verify_time_s=time.perf_counter() - drafted_at,
        source=draft.source,
    )


def first_round(
    target: Decoder,
    drafter: Drafter,
    tokens: list[int],
    room: int,
    sampling: SamplingParams,
    rng: Draws,
) -> RoundResult:
    """The first round after a prompt: one pass over what the target's cache lacks of it (at
    least the last token) and whatever the drafter proposes for free (a match: k = 0, so no
    model runs and a request's first token never waits for drafting). The drafter learns how
    its match fared, not what the pass cost (it fed the prompt's end too)."""
    step = speculative_round(target, drafter, tokens, 0, sampling, rng, limit=room)
    drafter.observe(step.source, step.drafted, step.accepted, step.draft_time_s, None)
    return step


def scheduled_round(
    target: Decoder,
    drafter: Drafter,
    schedule: DraftSchedule,
    tokens: list[int],
    room: int,
    sampling: SamplingParams,
    rng: Draws,
) -> RoundResult:
    """The one-row loop's round: ``schedule`` picks K (at most ``room``) and may stop the
    drafter early; it and the drafter then learn from how the round went."""
    k = schedule.start_round(room)
    step = speculative_round(
        target, drafter, tokens, k, sampling, rng, schedule.keep_drafting, room
    )
    times = step.draft_time_s, step.verify_time_s
    if step.source == "model":
        schedule.update(step.drafted, step.accepted, *times)
    drafter.observe(step.source, step.drafted, step.accepted, *times)
    return step


@dataclass
class RowRound:
    """One row's part in a batched round: its tokens (the target's cache holds all but the
    newest), how to sample, its own random stream, and how many draft tokens it verifies:
    the first ``k`` of the model's (fewer near its length limit), or ``match``, tokens proposed
    by matching (`LookupDrafter`: point masses) in their place. ``offset``: the row's first
    tokens the draft's cache leaves out (it reads a window of a long row)."""

    tokens: list[int]
    sampling: SamplingParams
    rng: Draws
    k: int
    match: list[int] | None = None
    source: str = "model"
    offset: int = 0

    @property
    def model_k(self) -> int:
        """Draft-model tokens this row uses (and draws for)."""
        return 0 if self.match else self.k


def batched_round(
    target: RowsDecoder,
    draft: RowsDecoder,
    rows: list[RowRound],
    k: int,
    start: int = 0,
) -> list[RoundResult]:
    """One round for rows ``start`` .. ``start + n - 1`` of both models' caches: K draft steps,
    each one draft call for every row (none when every row has a match), then ONE target call
    verifying ``[n, W+1]`` (W: the most draft tokens a row verifies); each row accepts its own
    prefix.
    A row uses its first ``row.k`` draft tokens or its match: it draws nothing past them (its
    random stream advances as if it were alone) and its later slots are filler. A row whose
    logits come out NaN/inf fails alone (its result's ``error``); the others go on as they
    would have."""
    started = time.perf_counter()
    n = len(rows)
    k = k if any(row.model_k for row in rows) else 0
    failed: dict[int, str] = {}
    if not k:
        drafts, q = np.zeros((n, 0), np.int64), []
    else:
        drafts, q = draft_rows(draft, rows, k, failed, start)
    drafts_per_row = [row.match or own for row, own in zip(rows, drafts.tolist())]
    drafted_at = time.perf_counter()

    k = max(row.k for row in rows)  # the verification width
    fed = np.zeros((n, k + 1), dtype=np.int64)
    for i, (row, proposed) in enumerate(zip(rows, drafts_per_row)):
        fed[i, 0] = row.tokens[-1]
        fed[i, 1 : 1 + row.k] = proposed[: row.k]  # the rest: filler
    greedy = all(row.sampling.greedy for row in rows)
    need = NEED_ARGMAX if greedy else NEED_LOGITS  # what a device backend brings back
    out = target.forward_rows(fed, keep_last=k + 1, start=start, need=need)
    verdicts: list[tuple[int, int]] = []
    if greedy and not failed:  # one argmax for the batch
        try:
            choices = greedy_tokens(_flat(out), "target")
            verdicts = [
                accept_greedy(drafts_per_row[i][: row.k], choices[i * (k + 1) : (i + 1) * (k + 1)])
                for i, row in enumerate(rows)
            ]
        except NumericalError:
            verdicts = []  # find the row(s) below
    if not verdicts:
        for i, row in enumerate(rows):
            row_out = _pick(out, (i, slice(0, row.k + 1)))
            row_q = q[i][: row.k] if q and q[i] is not None and not row.match else None
            verdicts.append(
                (0, 0)
                if i in failed
                else _row_verdict(
                    failed,
                    i,
                    drafts_per_row[i][: row.k],
                    row_q,
                    row_out,
                    row.sampling,
                    row.rng,
                    len(row.tokens),
                )
            )
    verify_time = time.perf_counter() - drafted_at
    return [
        RoundResult(
            drafted=row.k,
            accepted=accepted,
            tokens=[] if i in failed else [*drafts_per_row[i][:accepted], token],
            draft_time_s=drafted_at - started,
            verify_time_s=verify_time,
            source=row.source if row.match else "model",
            error=failed.get(i),
        )
        for i, (row, (accepted, token)) in enumerate(zip(rows, verdicts))
    ]


def first_tokens(target: RowsDecoder, rows: list[RowRound], start: int = 0) -> list[RoundResult]:
    """Each row's first token after its prompt (rows in slots ``start ..``): one call per row
    feeds what the target's cache lacks of the prompt (its end, as the one-row loop's first
    pass: at most a prefill chunk) and draws from the last position. A call of one row
    attends over that row's positions only; one over several rows would attend over the whole
    cache, which rows already running may have grown far past these prompts."""
    results = []
    for slot, row in enumerate(rows, start):
        started = time.perf_counter()
        fed = np.array([row.tokens[int(target.lengths[slot]) :]], dtype=np.int64)
        need = NEED_ARGMAX if row.sampling.greedy else NEED_LOGITS
        out = target.forward_rows(fed, keep_last=1, start=slot, need=need)
        failed: dict[int, str] = {}
        verdict = [], None, _pick(out, 0), row.sampling, row.rng, len(row.tokens)
        _, token = _row_verdict(failed, 0, *verdict)
        seconds = time.perf_counter() - started
        tokens = [] if failed else [token]
        results.append(RoundResult(0, 0, tokens, 0.0, seconds, "model", failed.get(0)))
    return results


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
) -> tuple[np.ndarray, list[np.ndarray | None]]:
    """K draft tokens for every row ``[n, K]`` (rows in slots ``start ..``) and, per sampled
    row, the distributions they were drawn from ``[K, V]``. The first call feeds each row what
    it has not yet seen (1 token, or 2 after a fully accepted round), right-padded to the
    longest (`catch_up` first when the draft is further behind). A row whose draft logits are
    NaN/inf is recorded in ``failed`` (its drafts are filler) instead of failing the others."""
    failed = {} if failed is None else failed
    n = len(rows)
    lengths = draft.lengths[start : start + n].tolist()
    unseen = [row.tokens[row.offset + length :] for row, length in zip(rows, lengths)]
    ids, fed = _right_padded(unseen)
    width = ids.shape[1]
    newest = (np.arange(n), fed - 1)  # each row's newest real token, in the first call's output
    drafts = np.zeros((n, k), dtype=np.int64)
    vocab = draft.vocab_size
    q = [None if row.sampling.greedy else np.empty((k, vocab), LOOP_DTYPE) for row in rows]
    greedy = all(row.sampling.greedy for row in rows)
    need = NEED_ARGMAX if greedy else NEED_LOGITS
    for step in range(k):
        if step == 0 and width > 1:
            out = draft.forward_rows(ids, keep_last=width, fed=fed, start=start, need=need)
            picked = _pick(out, newest)
        else:
            fed_now = ids if step == 0 else drafts[:, step - 1 : step]
            out = draft.forward_rows(fed_now, keep_last=1, start=start, need=need)
            picked = _pick(out, (slice(None), 0))
        if greedy and not failed:
            try:
                drafts[:, step] = greedy_tokens(picked, "draft")
                continue
            except NumericalError:
                pass  # find the row(s) below
        for i, row in enumerate(rows):
            if step >= row.model_k or i in failed:  # past this row's share: filler, no draw
                drafts[i, step] = drafts[i, step - 1] if step else 0
                continue
            try:
                drafts[i, step] = _draft_token(row, i, step, picked, q)
            except NumericalError as exc:
                failed[i] = str(exc)
    return drafts, q


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
        q[i][step] = warp(logits[i], s.temperature, s.top_k, s.top_p, "draft", LOOP_DTYPE)
    return draw(q[i][step], row.rng, len(row.tokens) + step)


def _pick(out: Forward, index) -> Forward:
    """What a rows call brought back (``[n, kept, V]`` arrays, or a device backend's argmax
    ``[n, kept]``), at ``index`` of its rows and positions."""
    fields = [out.logits, out.probabilities, out.argmax, out.max_logit, out.max_probability]
    logits, probabilities, argmax, top, top_p = (None if a is None else a[index] for a in fields)
    argmax = None if argmax is None else np.asarray(argmax).tolist()
    return Forward(logits, probabilities, argmax, top, top_p)


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
    one behind (after rounds without drafting, or a prompt it skipped), so that a round's first
    draft call feeds each row one or two tokens (rows in slots ``start ..``); the tokens fed.
    Rows far behind are fed apart from the others (`prefill_rows`)."""
    lengths = draft.lengths[start : start + len(rows)].tolist()
    unseen = [row.tokens[row.offset + length : -1] for row, length in zip(rows, lengths)]
    if max(map(len, unseen)) <= 1:
        return 0
    draft.prefill_rows(start, unseen)
    return sum(map(len, unseen))


def _right_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """``[n, longest]`` token ids, each row's padded at its end, and how many are real."""
    fed = np.array([len(tokens) for tokens in rows], dtype=np.int64)
    ids = np.zeros((len(rows), max(1, int(fed.max()))), dtype=np.int64)
    for i, tokens in enumerate(rows):
        ids[i, : len(tokens)] = tokens
    return ids, fed

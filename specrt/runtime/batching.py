"""Many sequences at once: rows share every model call, each with its own length, and a row
that finishes frees its slot for the next request at the round boundary (continuous refill).

Rows live in slots 0 .. n-1 of both models' caches (a call covers a contiguous block); when a
row finishes, the last row moves into its slot. Each row samples from its own random stream and
uses only its own share of the round's draft tokens. A seeded sampled row draws by position
(`KeyedDraws`): its tokens are the target alone's under its seed whatever is drafted, so they
do not depend on which rows share its batch, nor on how many, nor on the load schedule's K.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from specrt.backends import RowsDecoder
from specrt.backends.base import PREFILL_CHUNK, whole_chunks
from specrt.errors import InvalidInputError, NumericalError
from specrt.runtime.config import GenerationConfig
from specrt.runtime.drafters import Drafter
from specrt.runtime.hybrid import (
    DRAFT_WINDOW,
    MAX_MATCH_TOKENS,
    NO_MATCH_YET,
    HybridDrafter,
    MatchAcceptance,
    outcome,
)
from specrt.runtime.lookup import NgramIndex, Proposal, SuffixCache, find_match
from specrt.runtime.results import GenerationResult, GenerationStats
from specrt.runtime.round import (
    RoundResult,
    RowRound,
    batched_round,
    catch_up,
    first_round,
    first_tokens,
    scheduled_round,
)
from specrt.runtime.sampling import row_draws
from specrt.runtime.schedules import DraftSchedule, LoadSchedule
from specrt.runtime.stopping import StopStrings, settle
from specrt.runtime.tokenizer import BundleTokenizer

DEFAULT_BATCH_SIZE = 8  # rows per call of `specrt batch` (best measured on the demo pair)
# Requests per call of `specrt serve`: more clients than slots queue for whole requests, and
# their time to first token includes that wait (measured: docs/serve.md; CHANGELOG.md, 2026-11-30)
DEFAULT_SERVE_BATCH_SIZE = 16
MAX_BATCH = 256
# Rounds without a model draft that skip looking for matches after the load schedule found
# them not worth verifying (their acceptance is learnt only from verified ones, so it stands);
# twice as many each time that holds, up to 8x
MATCH_RECHECK_EVERY = 8
# Positions past the longest row a cache keeps when it gives back capacity steps (rows grow by
# a round's tokens at a time: a row about to pass the step would make it grow again at once).
SHRINK_HEADROOM = 32


@dataclass
class Request:
    """One sequence to generate: ``key`` names it in the results, ``prompt`` is its text or its
    token ids (checked: see `SpeculativeGenerator.encode_prompts`), ``config`` its settings.
    ``rng``: its random stream, by default its own, keyed by ``config.seed`` where it has one
    (a seeded row's tokens are the target alone's under that seed)."""

    key: Hashable
    prompt: str | list[int]
    config: GenerationConfig = field(default_factory=GenerationConfig)
    rng: np.random.Generator | None = None

    def __post_init__(self) -> None:
        if self.rng is None and isinstance(self.config, GenerationConfig):
            seed = self.config.seed
            self.rng = np.random.default_rng(None if seed is None else [seed, 0])


@dataclass
class _Row:
    request: Request
    tokens: list[int]
    limit: int  # the length at which it stops
    drafting: bool
    stats: GenerationStats
    started: float
    stopper: StopStrings | None = None
    index: NgramIndex | None = None  # prompt lookup over the row's text, unless "model"
    match_history: int = NO_MATCH_YET  # how its last match fared (`hybrid.outcome`), if any
    finish_reason: str = ""
    text: str | None = None  # cut before a stop string
    error: str | None = None  # why it failed (finish reason "error")
    # Its one-row drafter and schedule, and its own lookup (a hybrid is shared by rows)
    alone: tuple[Drafter, DraftSchedule, object] | None = None
    round: RowRound = field(init=False)

    def __post_init__(self) -> None:
        sampling = self.request.config.sampling
        rng = row_draws(self.request.config, self.request.rng)
        self.round = RowRound(self.tokens, sampling, rng, 0)


class BatchRunner:
    """Runs requests through the two batched decoders, up to ``target.max_batch`` at a time."""

    def __init__(
        self,
        target: RowsDecoder,
        draft: RowsDecoder,
        tokenizer: BundleTokenizer | None,
        eos_token_ids: frozenset[int],
        suffix_cache: SuffixCache | None = None,
        one_row: Callable[[GenerationConfig], tuple[Drafter, DraftSchedule]] | None = None,
    ) -> None:
        """``one_row``: a row's drafter and adaptive schedule for the rounds it runs alone
        (`SpeculativeGenerator.one_row`); without it every round is a batched one."""
        self.target, self.draft = target, draft
        self.one_row = one_row
        self.max_batch = min(target.max_batch, draft.max_batch)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.suffix_cache = suffix_cache
        self.schedules: dict[str, LoadSchedule] = {}  # by name: "fixed", "load"
        # How the hybrid rows' matches fare, greedy rows apart from sampled ones: a sampled row
        # keeps a matched token only with probability p(x).
        self.matches = {True: MatchAcceptance(), False: MatchAcceptance()}
        self.rows: list[_Row] = []  # in slots 0 .. len - 1
        self._matchless = 0  # rounds left that skip matching (`MATCH_RECHECK_EVERY`)
        self._matchless_next = MATCH_RECHECK_EVERY
        self._look_again = False  # a pause just ended: its first round verifies a width anyway

    def run(self, requests: Iterable[Request]) -> Iterator[tuple[Hashable, GenerationResult]]:
        """Yield ``(key, result)`` for each request as it finishes (not in request order).
        Requests are read only as slots free up, so an endless iterator is fine."""
        waiting = iter(requests)
        more = True
        while True:
            admitted = []
            while more and self.free > len(admitted):
                request = next(waiting, None)
                if request is None:
                    more = False
                else:
                    admitted.append(request)
            for request, result in self.add(admitted):
                yield request.key, result
            if not self.rows:
                if not more:
                    return
                continue
            for request, result in self.step():
                yield request.key, result

    @property
    def free(self) -> int:
        """Slots without a row."""
        return self.max_batch - len(self.rows)

    def add(self, requests: list[Request]) -> list[tuple[Request, GenerationResult]]:
        """Prefill ``requests`` into the next free slots and give each its first token
        (`active` has it); returns those finished at once (a prompt that fills its length, a
        first token that ends it)."""
        if not self.rows:  # the caches give back all they grew
            self.target.shrink()
            self.draft.shrink()
        rows = [self._new_row(request) for request in requests]
        finished = [(row.request, self._result(row)) for row in rows if row.finish_reason]
        # By prompt length: neighbours of like length share prefill calls (`padded_runs`)
        rows = sorted((row for row in rows if not row.finish_reason), key=lambda r: len(r.tokens))
        if rows:
            start = len(self.rows)
            self.rows.extend(rows)
            finished += self._leave(self._admit(rows, start))
        for cache in (self.target, self.draft):  # give back what rows that left had grown
            cache.shrink(SHRINK_HEADROOM)
        return finished

    def _admit(self, rows: list[_Row], start: int) -> list[int]:
        """Prefill ``rows`` into slots ``start ..`` and take their first tokens; the slots of
        those finished."""
        for slot in range(start, start + len(rows)):
            self.target.set_length(slot, 0)
            self.draft.set_length(slot, 0)
        # The target reads a prompt as the one-row loop does: its whole chunks, then a pass
        # over the rest whose last position gives the first token (`first_tokens`), so a
        # request's first token comes right after its own prompt, not after a round of the
        # batch. The draft sees all but the last prompt token.
        prompts = [row.request.prompt for row in rows]
        self.target.prefill_rows(start, [whole_chunks(prompt) for prompt in prompts])
        if any(row.drafting for row in rows) and self._model_drafts(rows, start):
            drafted = [prompt[:-1] if row.drafting else [] for row, prompt in zip(rows, prompts)]
            self.draft.prefill_rows(start, drafted)
        if start == 0 and len(rows) == 1 and self._runs_alone(rows[0]):
            steps = [self._first_alone(rows[0])]
        else:
            steps = first_tokens(self.target, [row.round for row in rows], start)
        done = []
        for slot, (row, step) in enumerate(zip(rows, steps), start):
            if step.error is not None:
                self._fail(row, slot, step.error)
            else:
                self.target.set_length(slot, len(row.tokens) + step.accepted)
                self._settle(row, step)
            if row.finish_reason:
                done.append(slot)
        if any(step.error is not None for step in steps):
            self._clear_stale()
        return done

    def step(self) -> list[tuple[Request, GenerationResult]]:
        """One round over every row; the rows that finished leave, freeing their slots."""
        return self._leave(self._round(self.rows, 0) if self.rows else [])

    def _leave(self, slots: list[int]) -> list[tuple[Request, GenerationResult]]:
        """The finished rows in ``slots`` leave (the last slot first: `_free` moves the last
        row into a freed slot); their results."""
        finished = []
        for slot in sorted(slots, reverse=True):
            row = self.rows[slot]
            self._free(slot)
            finished.append((row.request, self._result(row)))
        return finished

    def active(self) -> Iterator[tuple[Request, list[int]]]:
        """Each running request and its new tokens so far (valid until the next step)."""
        for row in self.rows:
            yield row.request, row.tokens[len(row.request.prompt) :]

    def cancel(self, key: Hashable) -> GenerationResult | None:
        """Drop the running request ``key`` (its slot is free for the next); its result so
        far, with finish reason "cancelled" (None: no such request is running)."""
        for slot, row in enumerate(self.rows):
            if row.request.key == key:
                self._free(slot)
                row.finish_reason = "cancelled"
                return self._result(row)
        return None

    def _new_row(self, request: Request) -> _Row:
        prompt, config = request.prompt, request.config
        k_max = config.num_draft_tokens
        stats = GenerationStats(prompt_tokens=len(prompt), accepted_per_position=[0] * k_max)
        limit = min(self.target.max_positions, len(prompt) + config.max_new_tokens)
        drafting = k_max > 0 and len(prompt) < self.draft.max_positions
        stopper = None
        if config.stop:
            if self.tokenizer is None:
                raise InvalidInputError("stop strings need the bundle's tokenizer")
            stopper = StopStrings(config.stop, self.tokenizer.incremental())
        row = _Row(request, list(prompt), limit, drafting, stats, time.perf_counter(), stopper)
        if config.proposer != "model":
            row.index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
            row.index.prompt_length = len(prompt)  # its first lookup may come rounds later
        if len(prompt) >= limit:
            row.finish_reason = "length"
        return row

    def _round(self, rows: list[_Row], start: int) -> list[int]:
        """One batched round over ``rows`` (in slots ``start ..``); returns the slots of rows
        that finished."""
        if len(rows) == 1 and self._runs_alone(rows[0]):
            return self._round_alone(rows[0])
        fits = self._fits(rows)
        schedule = self._schedule(rows)
        # The rows' matches come first: a round without a model draft verifies them, and the
        # model's draft must beat that round, not the target alone.
        skip = not schedule.last_k and self._matchless > 0
        self._matchless -= skip
        self._look_again |= skip and not self._matchless
        caps = [self._cap(row, fits) for row in rows]
        # Where the load schedule prices each width, a hybrid row's match may run past K, as
        # in the one-row hybrid: rows that share a call only pay for it where it pays.
        wide = schedule.adapt
        found: dict[int, Proposal] = {}  # by the row's index in ``rows``
        for i, (row, cap) in enumerate(zip(rows, caps)):
            if skip:  # matching paused: nothing to look for
                break
            hybrid = row.request.config.proposer == "hybrid"
            reach = self._match_reach(row, cap, fits) if wide and hybrid else cap
            proposal = self._find(row, reach)
            if proposal is not None:
                found[i] = proposal
        # Matches are measured before the model may shut them out: their acceptance is learnt
        # only from verified ones, and a prior priced below a measured model draft would never
        # be (a job could draft with the model throughout, slower than with matches;
        # CHANGELOG.md, 2026-12-02).
        unmeasured = wide and bool(found) and not schedule.matches_measured()
        probe = (self._look_again or unmeasured) and bool(found)
        self._look_again &= not probe
        width, without_draft = self._match_option(rows, found, schedule, probe)
        k = 0 if probe and width else self.draft_length(rows, without_draft)
        for row, cap in zip(rows, caps):
            row.round.k = 0 if row.request.config.proposer == "lookup" else min(k, cap)
            row.round.match = None
        priced = without_draft is not None
        matched = self._verified_matches(rows, found, caps, k, width, priced, probe, schedule)
        for i, proposal in matched.items():
            row = rows[i]
            row.round.k, row.round.match = len(proposal.tokens), proposal.tokens
            row.round.source = proposal.source
        parts = [row.round for row in rows]
        if k:  # a draft behind after rounds without drafting: not a cost of this K
            started = time.perf_counter()
            self._window(rows, start)
            fed = catch_up(self.draft, parts, start)
            schedule.charge(time.perf_counter() - started, fed)
        lengths = [len(row.tokens) for row in rows]
        resizes = self.target.resizes + self.draft.resizes
        started = time.perf_counter()
        steps = batched_round(self.target, self.draft, parts, k, start)
        seconds = time.perf_counter() - started
        # A round that grew a cache paid for copying it (a wide round most often, as its
        # positions pass the capacity first): not what its width costs.
        typical = resizes == self.target.resizes + self.draft.resizes
        finished = []
        failed = any(step.error is not None for step in steps)
        for i, (row, step) in enumerate(zip(rows, steps)):
            slot = start + i
            if step.error is not None:  # NaN/inf logits in this row: it fails alone
                self._fail(row, slot, step.error)
                finished.append(slot)
                continue
            self.target.set_length(slot, len(row.tokens) + step.accepted)
            self._settle(row, step)
            # The draft model saw the row up to the round's start; after it, its own tokens,
            # which stand only where they were the ones verified.
            seen = len(row.tokens) - 1 if i not in matched else lengths[i]
            self.draft.set_length(slot, min(len(row.tokens) - 1, seen) - row.round.offset)
            if i in matched:
                history = row.match_history
                acceptance = self.matches[row.request.config.greedy]
                acceptance.record(matched[i], history, step.drafted, step.accepted)
                row.match_history = outcome(step.drafted, step.accepted)
            if row.finish_reason:
                finished.append(slot)
        if failed:
            self._clear_stale()
        # What the load schedule chose, and how it went
        model = [i for i in range(len(rows)) if i not in matched]
        width = max(part.k for part in parts)  # matches may make the call wider
        schedule.update(
            len(rows), k, None if width > k or not typical else seconds,
            [parts[i] for i in model], [steps[i] for i in model],
        )  # fmt: skip
        if k == 0 and width > 0 and typical:  # matches alone: its width is what it cost
            schedule.update_match_width(len(rows), width, seconds)
        return finished

    def _window(self, rows: list[_Row], start: int) -> None:
        """Where the draft is more than `DRAFT_WINDOW` tokens behind a row (rounds without
        drafting, a prompt it skipped), it starts over at the row's last tokens, as the
        one-row hybrid's does: catching up on a whole long row cost more than the rounds it
        drafts for gain."""
        for slot, row in enumerate(rows, start):
            behind = len(row.tokens) - 1 - row.round.offset - int(self.draft.lengths[slot])
            if behind > DRAFT_WINDOW:
                row.round.offset = len(row.tokens) - 1 - DRAFT_WINDOW
                self.draft.set_length(slot, 0)

    def _runs_alone(self, row: _Row) -> bool:
        """A row alone in the batch drafts as a lone request does (its own schedule: the
        adaptive one stops drafting token by token, where the load schedule decides per
        round for rows sharing calls)."""
        return self.one_row is not None

    def _alone(self, row: _Row) -> tuple[Drafter, DraftSchedule]:
        """The lone row's drafter and schedule, set to the row: a hybrid is shared by rows
        (what it learns holds for the pair), so it is given this row's lookup index and match
        history, and its model where the draft's cache starts in the row."""
        config = row.request.config
        if row.alone is None:
            drafter, schedule = self.one_row(config)
            lookup = getattr(drafter, "lookup", None)
            if lookup is not None and row.index is not None:  # the row's own index goes on
                lookup.index = row.index
            row.alone = drafter, schedule, lookup
        drafter, schedule, lookup = row.alone
        model = drafter.model if isinstance(drafter, HybridDrafter) else drafter
        if isinstance(drafter, HybridDrafter):
            drafter.lookup, drafter.history = lookup, row.match_history
        if hasattr(model, "offset"):
            model.offset = row.round.offset
        return drafter, schedule

    def _room(self, row: _Row) -> int:
        """Draft tokens a lone row's round may verify: it emits at most that many + 1, and
        every position fed must fit in each model."""
        room = min(row.limit - len(row.tokens) - 1, self.draft.max_positions - len(row.tokens))
        return max(0, room) if row.drafting else 0

    def _first_alone(self, row: _Row) -> RoundResult:
        """A lone row's first token: one pass over what the target's cache lacks of the prompt
        and whatever its drafter proposes for free (a match; no model runs for it)."""
        drafter, _ = self._alone(row)
        # One call feeds at most a prefill chunk (TensorRT plans' largest profile)
        unread = len(row.tokens) - int(self.target.lengths[0])
        room = max(0, min(self._room(row), PREFILL_CHUNK - unread))
        sampling, rng = row.request.config.sampling, row.round.rng
        try:
            step = first_round(self.target, drafter, row.tokens, room, sampling, rng)
        except NumericalError as exc:  # as in a batched round: the row fails alone
            return RoundResult(0, 0, [], 0.0, 0.0, "model", str(exc))
        self._after_alone(row, drafter)
        return step

    def _after_alone(self, row: _Row, drafter: Drafter) -> None:
        """Keep what the lone row's round changed in a drafter that rows share."""
        if isinstance(drafter, HybridDrafter):
            row.match_history = drafter.history
        model = drafter.model if isinstance(drafter, HybridDrafter) else drafter
        row.round.offset = getattr(model, "offset", 0)

    def _round_alone(self, row: _Row) -> list[int]:
        """One round of the lone row (slot 0), drafting as its schedule says; [0] if it
        finished."""
        drafter, schedule = self._alone(row)
        tokens, sampling, rng = row.tokens, row.request.config.sampling, row.round.rng
        try:
            step = scheduled_round(
                self.target, drafter, schedule, tokens, self._room(row), sampling, rng
            )
        except NumericalError as exc:  # as in a batched round: the row fails alone
            self._fail(row, 0, str(exc))
            self._clear_stale()
            return [0]
        self._after_alone(row, drafter)
        self.target.set_length(0, len(tokens) + step.accepted)
        self._settle(row, step)
        drafter.rollback(len(tokens) - 1)
        return [0] if row.finish_reason else []

    def _settle(self, row: _Row, step: RoundResult) -> None:
        """Append the round's tokens that stand (up to EOS, a stop string or the length) and
        count them; set the finish reason if the row is done."""
        config = row.request.config
        settled = settle(
            row.tokens,
            len(row.request.prompt),
            step.tokens,
            self.eos_token_ids,
            config,
            row.stopper,
        )
        row.stats.add_round(step.drafted, min(step.accepted, settled.count), step.source)
        if settled.stopped:
            row.finish_reason, row.text = "stop", settled.text
        elif len(row.tokens) >= row.limit:
            row.finish_reason = "length"

    def _fail(self, row: _Row, slot: int, message: str) -> None:
        """End ``row`` (in ``slot``) with an error: its logits came out NaN/inf."""
        row.finish_reason, row.error = "error", message
        self.target.set_length(slot, 0)
        self.draft.set_length(slot, 0)

    def _clear_stale(self) -> None:
        """After a failed row: no NaN it left may stay where a later row could read it."""
        self.target.clear_stale()
        self.draft.clear_stale()

    def _cap(self, row: _Row, fits: int) -> int:
        """The most draft-model tokens ``row`` may have verified this round, and of its match
        where widths are not priced or the row is not a hybrid one (`_match_reach`)."""
        room = row.limit - len(row.tokens) - 1  # a round emits at most k + 1 tokens
        return min(room, row.request.config.num_draft_tokens, fits) if row.drafting else 0

    def _match_reach(self, row: _Row, cap: int, fits: int) -> int:
        """The most tokens of ``row``'s match a round may verify (its model cap ``cap`` > 0):
        up to `MAX_MATCH_TOKENS`, within its length limit and the caches."""
        room = row.limit - len(row.tokens) - 1
        return max(cap, min(MAX_MATCH_TOKENS, room, fits)) if cap > 0 else 0

    def _find(self, row: _Row, cap: int) -> Proposal | None:
        """The row's match of up to ``cap`` tokens (its own text, else the suffix cache)."""
        if row.index is None or cap <= 0:
            return None
        found = find_match(row.index, self.suffix_cache, row.tokens, cap)
        return found if found.tokens else None

    def _curve(self, row: _Row, proposal: Proposal) -> list[float]:
        """Tokens the row is expected to emit with 1, 2, ... of the match verified."""
        acceptance = self.matches[row.request.config.greedy]
        return acceptance.expected_tokens(proposal, row.match_history)

    def _match_option(
        self, rows: list[_Row], found: dict[int, Proposal], schedule: LoadSchedule, probe: bool
    ) -> tuple[int, float | None]:
        """How many tokens of the matches a round without a model draft would verify, and its
        expected tokens per second (None: not known), where the load schedule adapts;
        ``probe``: measure a width now (matches do not pay on what was learnt when they were
        last verified, and nothing is learnt while they are not)."""
        if not found or not schedule.adapt:
            return 0, None
        curves = [self._curve(rows[i], proposal) for i, proposal in found.items()]
        return schedule.match_option(len(rows), curves, probe)

    def _verified_matches(
        self,
        rows: list[_Row],
        found: dict[int, Proposal],
        caps: list[int],
        k: int,
        width: int,
        priced: bool,
        probe: bool,
        schedule: LoadSchedule,
    ) -> dict[int, Proposal]:
        """The matches the round verifies instead of the model's draft. Without a model draft
        (K = 0, adapting), ``width`` tokens of every match (0: none; where the widths were
        ``priced`` and none paid, matching then pauses for a while, `MATCH_RECHECK_EVERY`; a
        ``probe`` ending a pause does not make the next pause shorter): a match that is rarely
        kept (sampling, text that does not repeat) would make every row pay for a wider call.
        Otherwise, always for "lookup" rows; for "hybrid" rows where a match is expected to
        keep more tokens than the model's K (by what matches and model drafts kept so far).
        Where the load schedule adapts, a match fills the round's width and never widens it
        (every row pays for the widest)."""
        if not found:
            return {}
        adapts = schedule.adapt
        if adapts and not k:
            if not width and not priced:  # the round measures the target alone
                return {}
            if not width:
                self._matchless = self._matchless_next
                self._matchless_next = min(2 * self._matchless_next, 8 * MATCH_RECHECK_EVERY)
                return {}
            if not probe:  # a width that pays: the pauses start short again
                self._matchless_next = MATCH_RECHECK_EVERY
            return {i: p.first(width) for i, p in found.items()}
        verified = {}
        for i, proposal in found.items():
            row, config = rows[i], rows[i].request.config
            if adapts:
                proposal = proposal.first(k)
            if config.proposer == "lookup" or not k:
                verified[i] = proposal
            elif self._curve(row, proposal)[-1] >= schedule.expected_tokens(min(k, caps[i])):
                verified[i] = proposal
        return verified

    def draft_length(self, rows: list[_Row], without_draft: float | None = None) -> int:
        """The round's K for every row: the load schedule picks it for this many rows from
        measured round times and acceptance (K = 0 when drafting does not pay at this batch
        size); capped so that every row's positions fit in both caches."""
        k_max = max(
            row.request.config.num_draft_tokens
            if row.drafting and row.request.config.proposer != "lookup"
            else 0
            for row in rows
        )
        k_max = max(0, min(k_max, self._fits(rows)))
        if k_max == 0:
            return k_max
        lengths = self.draft.lengths[: len(rows)].tolist()
        backlog = sum(
            min(DRAFT_WINDOW, max(0, len(row.tokens) - 1 - row.round.offset - n))
            for row, n in zip(rows, lengths)
        )
        return self._schedule(rows).choose(len(rows), k_max, backlog, without_draft)

    def _fits(self, rows: list[_Row]) -> int:
        """Draft tokens every row's positions fit in both caches."""
        longest = max(len(row.tokens) for row in rows)
        return min(self.target.max_positions - longest, self.draft.max_positions - longest - 1)

    def _schedule(self, rows: list[_Row]) -> LoadSchedule:
        """One per draft schedule name: "fixed" always drafts K, the others adapt K to load."""
        names = {row.request.config.draft_schedule for row in rows}
        name = "fixed" if names == {"fixed"} else "load"
        if name not in self.schedules:
            self.schedules[name] = LoadSchedule(adapt=name == "load")
        return self.schedules[name]

    def _model_drafts(self, rows: list[_Row], start: int) -> bool:
        """Whether the draft model should read these admitted rows' prompts now: where K
        adapts to the load it may never draft for them, and the first round that drafts
        catches the draft up (`catch_up`, as after rounds without drafting), so a request's
        first token waits for the target's prefill alone; not for a fixed K, nor for a lone
        row drafting with the model alone (it drafts from its first round)."""
        if start == 0 and len(rows) == 1 and self._runs_alone(rows[0]):
            return rows[0].request.config.proposer == "model"
        return all(row.request.config.draft_schedule == "fixed" for row in rows)

    def _free(self, slot: int) -> None:
        """Drop the row in ``slot``; the last row moves into it (the slots stay packed)."""
        edge = len(self.rows) - 1
        if slot != edge:
            self.target.move_row(edge, slot)
            self.draft.move_row(edge, slot)
            self.rows[slot] = self.rows[-1]
        self.rows.pop()
        self.target.set_length(edge, 0)
        self.draft.set_length(edge, 0)

    def _result(self, row: _Row) -> GenerationResult:
        prompt = row.request.prompt
        k_max = row.request.config.num_draft_tokens
        row.stats.draft_stopped = k_max > 0 and len(row.tokens) >= self.draft.max_positions
        if self.suffix_cache is not None:
            self.suffix_cache.add(row.tokens)
        new_ids = row.tokens[len(prompt) :]
        row.stats.new_tokens = len(new_ids)
        text = row.text
        if text is None:
            text = self.tokenizer.decode(new_ids) if self.tokenizer is not None else ""
        row.stats.finish(time.perf_counter() - row.started)
        return GenerationResult(text, new_ids, row.finish_reason, row.stats, row.error)

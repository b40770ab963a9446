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

from specrt.backends import RowsDecoder
from specrt.backends.base import PREFILL_CHUNK, whole_chunks
from specrt.errors import InvalidInputError
from specrt.runtime.config import GenerationConfig
from specrt.runtime.corpus import CorpusTable
from specrt.runtime.grammar import row_grammar
from specrt.runtime.hybrid import DRAFT_WINDOW, MatchAcceptance
from specrt.runtime.logprobs import TokenLogprob
from specrt.runtime.lookup import NgramIndex, SuffixCache
from specrt.runtime.planning import BatchPlanner, LonePlanner, Plan
from specrt.runtime.prefixes import KeptRows, arrange, firsts_of
from specrt.runtime.requests import LoneLearners, Request, Row
from specrt.runtime.results import GenerationResult, GenerationStats
from specrt.runtime.round import RoundResult, catch_up, first_tokens, read_prompt, run_round
from specrt.runtime.schedules import LoadSchedule
from specrt.runtime.stopping import StopStrings, answer_text, settle
from specrt.runtime.tokenizer import BundleTokenizer

# config -> what a row running alone learns with (the hybrid's choice, schedule and guard)
OneRowLearners = Callable[[GenerationConfig], LoneLearners]

__all__ = ["DEFAULT_BATCH_SIZE", "DEFAULT_SERVE_BATCH_SIZE", "MAX_BATCH", "BatchRunner", "Request"]

DEFAULT_BATCH_SIZE = 8  # rows per call of `specrt batch` (best measured on the demo pair)
# Requests per call of `specrt serve`: more clients than slots queue for whole requests, and
# their time to first token includes that wait (measured: docs/serve.md; CHANGELOG.md, 2026-11-30)
DEFAULT_SERVE_BATCH_SIZE = 16
MAX_BATCH = 256
# Positions past the longest row a cache keeps when it gives back capacity steps (rows grow by
# a round's tokens at a time: a row about to pass the step would make it grow again at once).
SHRINK_HEADROOM = 32


class BatchRunner:
    """Runs requests through the two batched decoders, up to ``target.max_batch`` at a time."""

    def __init__(
        self,
        target: RowsDecoder,
        draft: RowsDecoder,
        tokenizer: BundleTokenizer | None,
        eos_token_ids: frozenset[int],
        suffix_cache: SuffixCache | None = None,
        one_row: OneRowLearners | None = None,
        corpus: CorpusTable | None = None,
    ) -> None:
        """``one_row``: a row's learners for the rounds it runs alone
        (`SpeculativeGenerator.one_row`); without it every round is planned for a batch."""
        self.target, self.draft = target, draft
        self.one_row = one_row
        self.max_batch = min(target.max_batch, draft.max_batch)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.suffix_cache = suffix_cache
        self.corpus = corpus
        self.planner = BatchPlanner(target, draft, suffix_cache)
        self.lone = LonePlanner(suffix_cache)
        self._left = False  # rows left since the caches last gave back what they had grown
        self.rows: list[Row] = []  # in slots 0 .. len - 1
        self.kept = KeptRows.of(target)  # finished rows in its free slots, whoever runs them

    @property
    def schedules(self) -> dict[str, LoadSchedule]:
        """The load schedules (by name), what they learnt: a generator keeps them across calls."""
        return self.planner.schedules

    @schedules.setter
    def schedules(self, schedules: dict[str, LoadSchedule]) -> None:
        self.planner.schedules = schedules

    @property
    def matches(self) -> dict[bool, MatchAcceptance]:
        """How matches fared, greedy rows (True) apart from sampled ones."""
        return self.planner.matches

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
            if admitted or self._left:  # (nothing to admit nor give back: a round's time saved)
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
        if not self.rows:  # the caches give back all they grew (not what kept rows hold)
            self.target.shrink(keep=self.kept.longest)
            self.draft.shrink()
        rows = [self._new_row(request) for request in requests]
        finished = [(row.request, self._result(row)) for row in rows if row.finish_reason]
        # By prompt length: neighbours of like length share prefill calls (`padded_runs`)
        rows = sorted((row for row in rows if not row.finish_reason), key=lambda r: len(r.tokens))
        if rows:
            start = len(self.rows)
            kept = self.kept.sources(start, len(rows))
            rows, sources = arrange(rows, self.rows, self.target.lengths, kept)
            for source in filter(None, sources):
                self.kept.used(source[0])
            self.rows.extend(rows)
            finished += self._leave(self._admit(rows, start, sources))
        # Give back what rows that left had grown. Kept rows keep theirs while a row runs alone
        # (its calls see its own positions only: `batched.VIEW_STEP`); rows sharing calls
        # would attend over it, so they take it back as they come.
        alone = len(self.rows) <= 1
        if self._left or not alone:
            self.target.shrink(SHRINK_HEADROOM, self.kept.longest if alone else 0)
        if self._left:
            self.draft.shrink(SHRINK_HEADROOM)
            self._left = False
        return finished

    def _admit(
        self, rows: list[Row], start: int, sources: list[tuple[int, int] | None]
    ) -> list[int]:
        """Prefill ``rows`` into slots ``start ..`` and take their first tokens; the slots of
        those finished. ``sources`` (`prefixes.arrange`): where a row copies its prompt's beginning
        from (the rows that do come after those that read their whole prompt)."""
        for slot in range(start, start + len(rows)):
            self.target.set_length(slot, 0)
            self.draft.set_length(slot, 0)
        # The target reads a prompt as the one-row loop does: its whole chunks, then a pass
        # over the rest whose last position gives the first token (`first_tokens`), right
        # after its own prompt. The draft sees all but the last prompt token. A prompt several
        # rows share is read once, by the first; the others copy its caches. A row whose prompt
        # begins as another's copies that beginning once the other's is read; reads the rest.
        prompts = [row.request.prompt for row in rows]
        asked = [row.request.config.prompt_logprobs for row in rows]  # a prompt's own logits
        firsts = firsts_of([p if top is None else None for p, top in zip(prompts, asked)])
        readers = sources.count(None)
        whole = [whole_chunks(p) if firsts[i] == i else [] for i, p in enumerate(prompts)]
        for i, top in enumerate(asked):  # read whole with its logits, all but the last token
            if top is not None:
                rows[i].prompt_logprobs = read_prompt(self.target, start + i, prompts[i], top)
                whole[i] = []
        self.target.prefill_rows(start, whole[:readers])
        if not self.draft.windowed:  # a head's slots of a running row's beginning are its own
            for i, source in enumerate(sources):
                if source and source[0] < start and firsts[i] == i and rows[i].drafting:
                    self.draft.copy_row(source[0], start + i, source[1])
        if any(row.drafting for row in rows) and self._model_drafts(rows, start):
            drafting = firsts_of([p if row.drafting else None for row, p in zip(rows, prompts)])
            drafted = [  # after what it holds: an EAGLE head holds a row's first token
                prompt[int(self.draft.lengths[start + i]) : -1]
                if row.drafting and drafting[i] == i
                else []
                for i, (row, prompt) in enumerate(zip(rows, prompts))
            ]
            self.draft.prefill_rows(start, drafted)
            for i, first in enumerate(drafting):
                if first != i and rows[i].drafting:
                    self.draft.copy_row(start + first, start + i)
        lone = start == 0 and len(rows) == 1 and self._runs_alone
        for i, row in enumerate(rows):
            row.round.k, row.round.match = 0, None
            row.stats.cached_tokens = 0 if firsts[i] == i else len(prompts[i])
        # A lone row's first pass may verify a match too (no model runs for it): planned once
        # its cache holds what it copies
        plan = self._plan_alone(rows[0], first=True) if lone and readers else None
        parts = [row.round for row in rows]
        results = first_tokens(self.target, parts[:readers], start)
        if readers < len(rows):
            for i in range(readers, len(rows)):
                source, shared = sources[i]
                if firsts[i] == i:  # (a failed pass leaves the positions before its NaN clean)
                    self.target.copy_row(source, start + i, shared)
                    rows[i].stats.cached_tokens = shared
            rest = [
                whole_chunks(p, int(self.target.lengths[start + i])) if firsts[i] == i else []
                for i, p in enumerate(prompts)
            ]
            self.target.prefill_rows(start + readers, rest[readers:])
            plan = self._plan_alone(rows[0], first=True) if lone else plan
            results += first_tokens(self.target, parts[readers:], start + readers)
        if lone:
            self._learn_alone(rows[0], plan, results[0], first=True)
        done = []
        for slot, (row, result) in enumerate(zip(rows, results), start):
            if result.error is not None:
                self._fail(row, slot, result.error)
            else:
                self.target.set_length(slot, len(row.tokens) + result.accepted)
                self._settle(row, result)
            if row.finish_reason:
                done.append(slot)
        if any(result.error is not None for result in results):
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

    def active(self) -> Iterator[tuple[Request, list[int], list[TokenLogprob] | None]]:
        """Each running request, its new tokens so far and their log-probabilities where its
        config asks for them (valid until the next step)."""
        for row in self.rows:
            yield row.request, row.tokens[len(row.request.prompt) :], row.logprobs

    def cancel(self, key: Hashable) -> GenerationResult | None:
        """Drop the running request ``key`` (its slot is free for the next); its result so
        far, with finish reason "cancelled" (None: no such request is running)."""
        for slot, row in enumerate(self.rows):
            if row.request.key == key:
                self._free(slot)
                row.finish_reason = "cancelled"
                return self._result(row)
        return None

    def _new_row(self, request: Request) -> Row:
        prompt, config = request.prompt, request.config
        k_max = config.num_draft_tokens
        stats = GenerationStats(prompt_tokens=len(prompt), accepted_per_position=[0] * k_max)
        limit = min(self.target.max_positions, len(prompt) + config.max_new_tokens)
        drafting = k_max > 0 and len(prompt) < self.draft.max_positions
        if config.stop and self.tokenizer is None:  # (callers check first: `check_config`)
            raise InvalidInputError("stop strings need the bundle's tokenizer")
        stopper = StopStrings.of(config, self.tokenizer)
        row = Row(request, list(prompt), limit, drafting, stats, time.perf_counter(), stopper)
        grammar = row_grammar(config, self.tokenizer, self.eos_token_ids, self.target.vocab_size)
        row.round.processors = config.processors_for(self.eos_token_ids, grammar)
        if config.proposer != "model":
            row.index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
            row.index.corpus = self.corpus
            row.index.prompt_length = len(prompt)  # its first lookup may come rounds later
        if len(prompt) >= limit:
            row.finish_reason = "length"
        return row

    def _round(self, rows: list[Row], start: int) -> list[int]:
        """One round over ``rows`` (in slots ``start ..``); the slots of rows that finished."""
        # 1. Plan: each row's share, the draft model's K tokens or a match: a lone row's by
        #    its own schedule, rows sharing calls' by the load schedule (`planning`)
        lone = len(rows) == 1 and self._runs_alone
        round_started = time.perf_counter()  # a lone row's guard times the round as a whole
        plan = self._plan_alone(rows[0]) if lone else self.planner.plan(rows)
        parts = [row.round for row in rows]
        # 2. Catch up: a draft behind after rounds without drafting reads what it missed (a
        #    cost of those rounds, not of this K)
        caught_up_s = 0.0
        if plan.k:
            started = time.perf_counter()
            self._window(rows, start)
            fed = catch_up(self.draft, parts, start)
            caught_up_s = time.perf_counter() - started if fed else 0.0
            if plan.schedule is not None:
                plan.schedule.charge(caught_up_s, fed)
        # 3. Draft, verify, accept: K draft calls, then ONE target call for every row
        lengths = [len(row.tokens) for row in rows]
        resizes = self.target.resizes + self.draft.resizes
        started = time.perf_counter()
        results = run_round(self.target, self.draft, parts, plan.k, start, plan.keep_drafting)
        seconds = time.perf_counter() - started
        # A round that grew a cache paid for copying it (a wide round most often, as its
        # positions pass the capacity first): not what its width costs.
        typical = resizes == self.target.resizes + self.draft.resizes
        # 4. Roll back and settle: each cache keeps what stands of its row
        finished = []
        for i, (row, result) in enumerate(zip(rows, results)):
            slot = start + i
            if result.error is not None:  # NaN/inf logits in this row: it fails alone
                self._fail(row, slot, result.error)
                finished.append(slot)
                continue
            self.target.set_length(slot, len(row.tokens) + result.accepted)
            self._settle(row, result)
            # The draft model saw the row up to the round's start; after it, its own tokens,
            # which stand only where they were the ones verified.
            seen = len(row.tokens) - 1 if i not in plan.matched else lengths[i]
            self.draft.set_length(slot, min(len(row.tokens) - 1, seen) - row.round.offset)
            if row.finish_reason:
                finished.append(slot)
        if any(result.error is not None for result in results):
            self._clear_stale()
        # 5. Learn: the schedules, match acceptance, the hybrid's rates
        if lone:
            round_seconds = time.perf_counter() - round_started
            seconds = round_seconds if typical else None
            self._learn_alone(rows[0], plan, results[0], seconds, caught_up_s=caught_up_s)
        else:
            self.planner.learn(rows, plan, results, seconds if typical else None)
        return finished

    def _window(self, rows: list[Row], start: int) -> None:
        """Where the draft is more than `DRAFT_WINDOW` tokens behind a row (rounds without
        drafting, a prompt it skipped), it starts over at the row's last tokens, as the
        one-row hybrid's does: catching up on a whole long row cost more than the rounds it
        drafts for gain. Not for a draft that must read every position (an EAGLE head)."""
        if not self.draft.windowed:
            return
        for slot, row in enumerate(rows, start):
            behind = len(row.tokens) - 1 - row.round.offset - int(self.draft.lengths[slot])
            if behind > DRAFT_WINDOW:
                row.round.offset = len(row.tokens) - 1 - DRAFT_WINDOW
                self.draft.set_length(slot, 0)

    @property
    def _runs_alone(self) -> bool:
        """Whether a row alone in the batch drafts as a lone request does (its own schedule:
        the adaptive one stops drafting token by token, where the load schedule decides per
        round for rows sharing calls): where the generator gives its learners."""
        return self.one_row is not None

    def _plan_alone(self, row: Row, first: bool = False) -> Plan:
        """The lone row's share of its round, as its own schedule and hybrid choose."""
        if row.alone is None:
            row.alone = self.one_row(row.request.config)
            if row.alone.guard is not None:
                row.alone.guard.new_row()
        room = self._room(row)
        if first:  # one call feeds at most a prefill chunk (TensorRT plans' largest profile)
            unread = len(row.tokens) - int(self.target.lengths[0])
            room = max(0, min(room, PREFILL_CHUNK - unread))
        return self.lone.plan(row, room, row.alone, first)

    def _learn_alone(
        self,
        row: Row,
        plan: Plan,
        result: RoundResult,
        seconds: float | None = None,
        first: bool = False,
        caught_up_s: float = 0.0,
    ) -> None:
        if result.error is None:
            self.lone.learn(row, plan, result, row.alone, seconds, first, caught_up_s)

    def _room(self, row: Row) -> int:
        """Proposed tokens a lone row's round may verify: it emits at most that many + 1, and
        every position fed must fit in each model."""
        room = min(row.limit - len(row.tokens) - 1, self.draft.max_positions - len(row.tokens))
        return max(0, room) if row.drafting else 0

    def _settle(self, row: Row, result: RoundResult) -> None:
        """Append the round's tokens that stand (up to EOS, a stop string or the length) and
        count them; set the finish reason if the row is done."""
        config, before = row.request.config, len(row.tokens)
        settled = settle(
            row.tokens,
            len(row.request.prompt),
            result.tokens,
            self.eos_token_ids,
            config,
            row.stopper,
        )
        row.stats.add_round(result.drafted, min(result.accepted, settled.count), result.source)
        if row.logprobs is not None and result.logprobs:
            row.logprobs += result.logprobs[: len(row.tokens) - before]
        if settled.stopped:
            row.finish_reason, row.text = "stop", settled.text
        elif len(row.tokens) >= row.limit:
            row.finish_reason = "length"

    def _fail(self, row: Row, slot: int, message: str) -> None:
        """End ``row`` (in ``slot``) with an error: its logits came out NaN/inf."""
        row.finish_reason, row.error = "error", message
        self.target.set_length(slot, 0)
        self.draft.set_length(slot, 0)

    def _clear_stale(self) -> None:
        """After a failed row: no NaN it left stays where a later row (or kept row) reads."""
        self.target.clear_stale()
        self.draft.clear_stale()

    def _model_drafts(self, rows: list[Row], start: int) -> bool:
        """Whether the draft model should read these admitted rows' prompts now: where K
        adapts to the load it may never draft for them, and the first round that drafts
        catches the draft up (`catch_up`, as after rounds without drafting), so a request's
        first token waits for the target's prefill alone; not for a fixed K, nor for a lone
        row drafting with the model alone (it drafts from its first round)."""
        if start == 0 and len(rows) == 1 and self._runs_alone:
            return rows[0].request.config.proposer == "model"
        return all(row.request.config.draft_schedule == "fixed" for row in rows)

    def _free(self, slot: int) -> None:
        """Drop the row in ``slot``, its target cache kept for prompts that begin as it did
        (`KeptRows.keep`); the last row moves into it (the slots stay packed)."""
        self._left = True
        edge = len(self.rows) - 1
        self.kept.keep(slot, self.rows[slot].tokens[: int(self.target.lengths[slot])], edge)
        if slot != edge:
            self.target.move_row(edge, slot)
            self.draft.move_row(edge, slot)
            self.rows[slot] = self.rows[-1]
        self.rows.pop()
        self.target.set_length(edge, 0)
        self.draft.set_length(edge, 0)

    def _result(self, row: Row) -> GenerationResult:
        prompt = row.request.prompt
        k_max = row.request.config.num_draft_tokens
        row.stats.draft_stopped = k_max > 0 and len(row.tokens) >= self.draft.max_positions
        if self.suffix_cache is not None:
            self.suffix_cache.add(row.tokens)
        new_ids = row.tokens[len(prompt) :]
        row.stats.new_tokens = len(new_ids)
        text = row.text
        if text is None:
            text = answer_text(self.tokenizer, new_ids, row.request.config, self.eos_token_ids)
        row.stats.finish(time.perf_counter() - row.started)
        result = GenerationResult(text, new_ids, row.finish_reason, row.stats, row.error)
        result.logprobs, result.prompt_logprobs = row.logprobs, row.prompt_logprobs
        return result

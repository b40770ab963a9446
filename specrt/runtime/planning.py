"""What each row of a batched round verifies: the draft model's K tokens, K chosen for the
whole batch by the load schedule, or a match (prompt lookup, the suffix cache) where it is
expected to give more; and what the planner learns from how the round went."""

from __future__ import annotations

from dataclasses import dataclass

from specrt.backends import RowsDecoder
from specrt.runtime.hybrid import (
    DRAFT_WINDOW,
    MAX_MATCH_TOKENS,
    MatchAcceptance,
    outcome,
)
from specrt.runtime.lookup import Proposal, SuffixCache, find_match
from specrt.runtime.requests import LoneLearners, Row
from specrt.runtime.round import RoundResult
from specrt.runtime.schedules import KeepGoing, LoadSchedule
from specrt.runtime.schedules.constants import GUARD_PROBE_MATCH
from specrt.runtime.schedules.guard import CORPUS, MATCH, MODEL, PLAIN, SpeculationGuard

# Rounds without a model draft that skip looking for matches after the load schedule found
# them not worth verifying (their acceptance is learnt only from verified ones, so it stands);
# twice as many each time that holds, up to 8x
MATCH_RECHECK_EVERY = 8
GRAMMAR = "grammar"  # the source of the tokens a structured output's grammar forces


@dataclass
class Plan:
    """A round's plan: ``k`` draft-model steps (0: the model does not run), the rows (by index
    in the round) that verify a match instead, the load schedule that chose (None: a lone
    row's own schedule did), and that schedule's say after each draft token, if it has one."""

    k: int
    matched: dict[int, Proposal]
    schedule: LoadSchedule | None
    keep_drafting: KeepGoing | None = None


class BatchPlanner:
    """Plans rounds of rows sharing calls (each row's ``round`` is set to its share), and
    learns from them. Kept by the runner: what it learns holds for the pair and machine."""

    def __init__(
        self, target: RowsDecoder, draft: RowsDecoder, suffix_cache: SuffixCache | None
    ) -> None:
        self.target, self.draft, self.suffix_cache = target, draft, suffix_cache
        self.schedules: dict[str, LoadSchedule] = {}  # by name: "fixed", "load"
        # How the hybrid rows' matches fare, greedy rows apart from sampled ones: a sampled row
        # keeps a matched token only with probability p(x).
        self.matches = {True: MatchAcceptance(), False: MatchAcceptance()}
        self._matchless = 0  # rounds left that skip matching (`MATCH_RECHECK_EVERY`)
        self._matchless_next = MATCH_RECHECK_EVERY
        self._look_again = False  # a pause just ended: its first round verifies a width anyway

    def plan(self, rows: list[Row]) -> Plan:
        """Each row's share of the round (``row.round``: its K, or its match)."""
        fits = self.fits(rows)
        schedule = self.schedule(rows)
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
        for i, (row, cap) in enumerate(zip(rows, caps)):  # kept for sure: before any draft
            forced = [] if i in matched else _forced(row, cap)
            if forced:
                matched[i] = Proposal(forced, 0, GRAMMAR)
        for i, proposal in matched.items():
            row = rows[i]
            row.round.k, row.round.match = len(proposal.tokens), proposal.tokens
            row.round.source = proposal.source
        return Plan(k, matched, schedule)

    def learn(
        self,
        rows: list[Row],
        plan: Plan,
        results: list[RoundResult],
        seconds: float | None,
    ) -> None:
        """What the round taught: each verified match's acceptance, and the load schedule the
        round's time (``seconds``; None where the round was not a typical one: it grew a
        cache) against its K."""
        k, matched, schedule = plan.k, plan.matched, plan.schedule
        for i, proposal in matched.items():
            row, result = rows[i], results[i]
            if result.error is None and proposal.source != GRAMMAR:  # (kept for sure)
                acceptance = self.matches[row.request.config.greedy]
                acceptance.record(proposal, row.match_history, result.drafted, result.accepted)
                row.match_history = outcome(result.drafted, result.accepted)
        parts = [row.round for row in rows]
        model = [i for i in range(len(rows)) if i not in matched]
        width = max(part.k for part in parts)  # matches may make the call wider
        schedule.update(
            len(rows), k, None if width > k or seconds is None else seconds,
            [parts[i] for i in model], [results[i] for i in model],
        )  # fmt: skip
        if k == 0 and width > 0 and seconds is not None:  # matches alone: what that width cost
            schedule.update_match_width(len(rows), width, seconds)

    def _cap(self, row: Row, fits: int) -> int:
        """The most draft-model tokens ``row`` may have verified this round, and of its match
        where widths are not priced or the row is not a hybrid one (`_match_reach`)."""
        room = row.limit - len(row.tokens) - 1  # a round emits at most k + 1 tokens
        return min(room, row.request.config.num_draft_tokens, fits) if row.drafting else 0

    def _match_reach(self, row: Row, cap: int, fits: int) -> int:
        """The most tokens of ``row``'s match a round may verify (its model cap ``cap`` > 0):
        up to `MAX_MATCH_TOKENS`, within its length limit and the caches."""
        room = row.limit - len(row.tokens) - 1
        return max(cap, min(MAX_MATCH_TOKENS, room, fits)) if cap > 0 else 0

    def _find(self, row: Row, cap: int) -> Proposal | None:
        """The row's match of up to ``cap`` tokens (its own text, else the suffix cache)."""
        return _match(row, self.suffix_cache, cap)

    def _curve(self, row: Row, proposal: Proposal) -> list[float]:
        """Tokens the row is expected to emit with 1, 2, ... of the match verified."""
        acceptance = self.matches[row.request.config.greedy]
        return acceptance.expected_tokens(proposal, row.match_history)

    def _match_option(
        self, rows: list[Row], found: dict[int, Proposal], schedule: LoadSchedule, probe: bool
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
        rows: list[Row],
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

    def draft_length(self, rows: list[Row], without_draft: float | None = None) -> int:
        """The round's K for every row: the load schedule picks it for this many rows from
        measured round times and acceptance (K = 0 when drafting does not pay at this batch
        size); capped so that every row's positions fit in both caches."""
        k_max = max(
            row.request.config.num_draft_tokens
            if row.drafting and row.request.config.proposer != "lookup"
            else 0
            for row in rows
        )
        k_max = max(0, min(k_max, self.fits(rows)))
        if k_max == 0:
            return k_max
        lengths = self.draft.lengths[: len(rows)].tolist()
        backlog = sum(
            min(DRAFT_WINDOW, max(0, len(row.tokens) - 1 - row.round.offset - n))
            for row, n in zip(rows, lengths)
        )
        return self.schedule(rows).choose(len(rows), k_max, backlog, without_draft)

    def fits(self, rows: list[Row]) -> int:
        """Draft tokens every row's positions fit in both caches."""
        longest = max(len(row.tokens) for row in rows)
        return min(self.target.max_positions - longest, self.draft.max_positions - longest - 1)

    def schedule(self, rows: list[Row]) -> LoadSchedule:
        """One per draft schedule name: "fixed" always drafts K, the others adapt K to load."""
        names = {row.request.config.draft_schedule for row in rows}
        name = "fixed" if names == {"fixed"} else "load"
        if name not in self.schedules:
            even_rows = getattr(self.target.spec, "even_rows", False)
            self.schedules[name] = LoadSchedule(adapt=name == "load", even_rows=even_rows)
        return self.schedules[name]


class LonePlanner:
    """Plans the rounds of a row alone in the batch (a lone request, a job's last row) as it
    would run by itself: its own draft schedule picks K (the adaptive one stops the draft
    token by token: `Plan.keep_drafting`); a hybrid row verifies its match where `HybridChoice`
    expects it to beat the model's rounds; a lookup row, its match of up to K tokens. The
    schedule and the hybrid are the generator's, kept across rows (what they learn holds for
    the pair); they learn from every lone round (`learn`)."""

    def __init__(self, suffix_cache: SuffixCache | None) -> None:
        self.suffix_cache = suffix_cache

    def plan(
        self,
        row: Row,
        room: int,
        learners: LoneLearners,
        first: bool = False,
    ) -> Plan:
        """Set the row's share of the round (``room``: the most tokens it may verify). The
        ``first`` round after its prompt has no model draft: a request's first token never
        waits for drafting (a match costs nothing). Where the row has a guard, what it does
        not allow this round (`SpeculationGuard.caps`) is left out."""
        config, part = row.request.config, row.round
        forced = _forced(row, room)
        if forced:  # the grammar allows these alone: a round verifies them, kept for sure
            part.match, part.k, part.source = forced, len(forced), GRAMMAR
            return Plan(0, {0: Proposal(forced, 0, GRAMMAR)}, None)
        hybrid, schedule, guard = learners
        model_cap, match_cap = (room, room) if guard is None else guard.caps()
        corpus_cap = room if guard is None else guard.corpus
        lookup = config.proposer == "lookup"  # its schedule gives the match's length
        k = 0 if first else schedule.start_round(room if lookup else min(room, model_cap))
        found, length = None, 0
        if guard is not None and not match_cap and config.proposer != "model":
            match_cap = self._copy_probe(row, k if lookup else room, guard)
        if lookup:
            found = _match(row, self.suffix_cache, min(k, match_cap), min(k, corpus_cap))
            length = len(found.tokens) if found is not None else 0
        elif config.proposer == "hybrid" and hybrid is not None:
            # A probe of matches verifies a few tokens, where the whole match would be worth
            # verifying: judged by its probe's length, it would never beat the model's rounds.
            caps = {MATCH: match_cap, CORPUS: corpus_cap}
            for kind, cap in caps.items():
                probing = guard is not None and cap and guard.probing(kind)
                caps[kind] = min(room, hybrid.max_match_tokens, room if probing else cap)
            found = _match(row, self.suffix_cache, caps[MATCH], caps[CORPUS])
            length = hybrid.choose(found, k, row.match_history) if found is not None else 0
            corpus = found is not None and found.source == "corpus"
            length = min(length, corpus_cap if corpus else match_cap)
        if length:  # the round verifies the match: the model does not draft
            part.match, part.k, part.source = found.tokens[:length], length, found.source
            return Plan(0, {0: found}, None)
        part.match, part.k = None, 0 if config.proposer == "lookup" else k
        return Plan(part.k, {}, None, schedule.keep_drafting if part.k else None)

    def _copy_probe(self, row: Row, cap: int, guard: SpeculationGuard) -> int:
        """Where the guard holds matches off: the tokens of a match to verify anyway, where the
        row's own output repeats itself as far as the longest n-gram looked for (the onset of a
        copy, which a probe at its own time would find late); the guard spaces these out."""
        found = _match(row, self.suffix_cache, min(cap, GUARD_PROBE_MATCH), 0)
        config = row.request.config
        copying = found is not None and found.from_output
        if copying and found.match >= config.prompt_lookup_max and guard.copy_probe():
            return GUARD_PROBE_MATCH
        return 0

    def learn(
        self,
        row: Row,
        plan: Plan,
        result: RoundResult,
        learners: LoneLearners,
        seconds: float | None = None,
        first: bool = False,
        caught_up_s: float = 0.0,
    ) -> None:
        """The schedule learns from the model's rounds, the hybrid from every round (not the
        time of the first: it fed the prompt's end too), the guard from every round's
        ``seconds`` as a whole (None: not timed), ``caught_up_s`` of them the draft catching
        up before the round."""
        hybrid, schedule, guard = learners
        if GRAMMAR in (found.source for found in plan.matched.values()):
            return  # kept for sure: no measure of drafting, nor of a plain round
        verify_time = None if first else result.verify_time_s
        if guard is not None and seconds is not None and not first:
            kind = PLAIN if not result.drafted else MODEL
            if plan.matched:
                kind = CORPUS if plan.matched[0].source == "corpus" else MATCH
            guard.observe(kind, result.accepted + 1, seconds, caught_up_s)
        if result.source == "model" and verify_time is not None:
            schedule.update(result.drafted, result.accepted, result.draft_time_s, verify_time)
        if hybrid is not None:
            found = plan.matched.get(0)
            history = row.match_history
            args = result.drafted, result.accepted, result.draft_time_s, verify_time
            row.match_history = hybrid.observe(found, history, *args)


def _forced(row: Row, cap: int) -> list[int]:
    """Up to ``cap`` tokens a structured output's grammar allows alone after the row's."""
    grammar = row.round.processors and row.round.processors.grammar
    if not grammar or cap <= 0:
        return []
    return grammar.forced(row.tokens[row.round.prompt_length :])[:cap]


def _match(
    row: Row, suffix_cache: SuffixCache | None, cap: int, corpus_cap: int | None = None
) -> Proposal | None:
    """The row's match of up to ``cap`` tokens (its own text, else the suffix cache), or its
    corpus's proposal of up to ``corpus_cap`` (default: ``cap``; 0: none), as `find_match`
    chooses; under a structured output, only as far as its grammar allows."""
    corpus_cap = cap if corpus_cap is None else corpus_cap
    if row.index is None or max(cap, corpus_cap) <= 0:
        return None
    found = find_match(row.index, suffix_cache, row.tokens, max(cap, corpus_cap), corpus_cap > 0)
    found = found.first(corpus_cap if found.source == "corpus" else cap)
    grammar = row.round.processors and row.round.processors.grammar
    if grammar and found.tokens:  # a token the grammar refuses is rejected: not worth verifying
        found = found.first(
            grammar.valid_prefix(row.tokens[row.round.prompt_length :], found.tokens)
        )
    return found if found.tokens else None

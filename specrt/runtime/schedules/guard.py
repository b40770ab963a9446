"""The guard that keeps a lone row never slower than the target alone (``draft_schedule``
"adaptive"): each kind of speculation, the draft model's rounds and verified matches, stays on
only while its rounds, timed end to end, emit more tokens per second than plain rounds (the
target alone: one token a pass). A bundle's corpus (`specrt.runtime.corpus`) is a kind of its
own: its proposals come nearly every round and each is kept a third of the time or so, so it is
judged on longer probes, by no margin, and a probe round keeping nothing does not end it.

The schedules and the hybrid price a round from its parts (draft steps, the verification line).
What those leave out, a draft catching up after rounds of matches, a round's first draft step on
cold caches, the loop's own work, is a few percent of a pass a round: on a real chat model a
weak draft or rarely kept matches then decode slower than the target alone while every part
looks worth it (CHANGELOG.md, 2026-12-04). So a round is judged by what it took as a whole,
against plain rounds measured the same way (a plain round costs nothing against the target
alone: it is what it does). A probe's verdict leaves out the draft catching up before its rounds
(the prompt; the rounds it was off): paid once, it is not what the kind's rounds cost from then
on, and an EAGLE head's reading of the prompt made a head that pays look a loss for its whole
row. What it read of the rounds it was off counts in what the probe lost (the next probe reads
again what the kind misses while off); the row's prompt does not: it is read once a row whatever
the verdict, and on the demo head it alone set the longest wait, so a head whose first draft was
rejected stayed off for the rest of a fresh request. A kind judged a loss is probed again after
`GUARD_FIRST_WAIT` rounds, then twice as long each time it still loses (and never sooner than
what the probe lost is paid for by the rounds without it), early in each new row (its text may
repeat where the last did not) and, for matches, where the row starts to repeat its own output
(`LonePlanner`); a probe whose first rounds keep nothing ends there, the draft model's only
where they lost a plain round's worth (`GUARD_EMPTY_LOSS`). Matches a probe turns on again
after a loss verify a few tokens first (`GUARD_MATCH_RAMP`), twice as many after each round
that keeps them all: a probe's one-token rounds can be lucky. The output is the target's
whatever is verified.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from specrt.runtime.schedules.constants import (
    GUARD_COPY_SPACING,
    GUARD_CORPUS_ON_MARGIN,
    GUARD_CORPUS_ROUNDS,
    GUARD_DECAY,
    GUARD_EMPTY_LOSS,
    GUARD_EMPTY_ROUNDS,
    GUARD_FIRST_ROUNDS,
    GUARD_FIRST_WAIT,
    GUARD_MATCH_ON_MARGIN,
    GUARD_MATCH_RAMP,
    GUARD_MAX_WAIT,
    GUARD_MIN_ROUNDS,
    GUARD_PLAIN_EVERY,
    GUARD_PLAIN_KEPT,
    GUARD_PLAIN_SAMPLES,
    GUARD_PROBE_BUDGET,
    GUARD_PROBE_MATCH,
    GUARD_ROW_PROBE,
)

MODEL, MATCH, CORPUS, PLAIN = "model", "match", "corpus", "plain"
UNCAPPED = 1 << 30  # the tokens a kind that is on may propose: what the row's learners choose


class KindRate:
    """One kind's recent rounds (decayed sums) and its state: "probe" (its first rounds, and
    again after ``wait`` rounds off: `GUARD_MIN_ROUNDS` rounds of at most ``probe_tokens``
    tokens), "judge" (a probe done, waiting for plain rounds to compare with), "on" or "off"."""

    def __init__(
        self,
        probe_tokens: int,
        empty_loss: float = 0.0,
        on_margin: float = 0.0,
        probe_rounds: int = GUARD_MIN_ROUNDS,
        empty_rounds: int | None = GUARD_EMPTY_ROUNDS,
        ramp: int | None = None,
    ) -> None:
        self.probe_tokens = probe_tokens
        self.empty_loss = empty_loss  # plain rounds' worth: see `judge`
        self.on_margin = on_margin  # a share: by how much a probe must beat plain rounds
        self.min_rounds = probe_rounds  # of a probe
        self.empty_rounds = empty_rounds  # rounds keeping nothing that end a probe (None: no)
        self.wait = GUARD_FIRST_WAIT
        self.lost = False  # judged a loss before: a probe that loses again doubles the wait
        self.read_row = False  # whether its draft has read the current row (its prompt)
        self.ramp_start = ramp  # tokens it may propose first when turned on after a loss
        self.ramp: int | None = None  # the cap while on (None: none), doubled as it keeps all
        self.start_probe(max(GUARD_FIRST_ROUNDS, probe_rounds))

    def start_probe(self, rounds: int | None = None) -> None:
        """Measure it afresh for ``rounds`` rounds (its probes' length if None): its verdict
        is on the probe's alone."""
        rounds = self.min_rounds if rounds is None else rounds
        self.state = "probe"
        self.tokens = self.seconds = 0.0
        # The draft reading what it had not seen before the probe's rounds (the prompt, rounds
        # without it): paid once, so not what its rounds cost from then on, but what it lost.
        self.catch_up_s = 0.0
        self.rounds = 0  # in the sums
        self.kept = 0  # proposed tokens kept in them
        self.probe_rounds = rounds
        self.off_for = 0
        self.probed_this_row = True

    def add(self, tokens: int, seconds: float, catch_up_s: float = 0.0) -> None:
        """A round of ``tokens`` in ``seconds``, ``catch_up_s`` of them the draft catching up
        (left out of a probe's rate, counted in what it lost)."""
        if self.state == "probe":
            if self.read_row:  # not the row's prompt: what the next probe reads again
                self.catch_up_s += catch_up_s
            seconds -= catch_up_s
        self.read_row = True
        self.tokens = GUARD_DECAY * self.tokens + tokens
        self.seconds = GUARD_DECAY * self.seconds + seconds
        self.rounds += 1
        self.kept += tokens - 1  # a round emits the kept tokens and one of the target's
        if self.state == "on" and self.ramp is not None and tokens - 1 >= self.ramp:
            self.ramp *= 2
        # A probe ends at its length, or as soon as its first rounds kept nothing: it can only
        # have lost (its rounds took longer than plain ones for their one token).
        empty = self.empty_rounds is not None and self.rounds >= self.empty_rounds
        if self.state == "probe" and (self.rounds >= self.probe_rounds or empty and not self.kept):
            self.state = "judge"

    @property
    def cap(self) -> int:
        """The most tokens it may propose this round (0: none)."""
        on = UNCAPPED if self.ramp is None else self.ramp
        return {"on": on, "probe": self.probe_tokens}.get(self.state, 0)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def judge(self, baseline: float) -> None:
        """On where its recent rounds emit at least ``baseline`` tokens a second (the target
        alone's; after a probe, ``on_margin`` more), else off, until a probe after ``wait``
        rounds: twice the last wait where a probe lost again, and long enough that what the
        probe lost is `GUARD_PROBE_BUDGET` of the time until the next."""
        margin = self.on_margin if self.state == "judge" else 0.0  # a probe's few rounds
        if self.rate >= baseline * (1 + margin):
            if self.state == "judge":  # a probe's few rounds: a lucky one after losses ramps
                self.ramp = self.ramp_start if self.lost else None
            self.state, self.wait, self.lost = "on", GUARD_FIRST_WAIT, False
            return
        lost_rounds = (self.seconds + self.catch_up_s) * baseline - self.tokens  # plain rounds
        # A probe that kept nothing yet (judged before its end): a start that lost under
        # ``empty_loss`` says little (a draft keeping half its first tokens starts so half
        # the time). It goes on.
        if (
            self.state == "judge"
            and self.rounds < self.probe_rounds
            and lost_rounds < self.empty_loss
        ):
            self.state = "probe"
            return
        if self.state == "judge":
            if self.lost:
                self.wait = 2 * self.wait
            paid_for = math.ceil(lost_rounds / GUARD_PROBE_BUDGET)
            self.wait = min(max(self.wait, paid_for), GUARD_MAX_WAIT)
        self.state, self.off_for, self.lost = "off", 0, True


class SpeculationGuard:
    """Per generator and settings (shared by its lone rows, as the hybrid is): what the loop
    asks before a lone round (`caps`) and tells after it (`observe`)."""

    def __init__(self) -> None:
        self.kinds = {
            MODEL: KindRate(UNCAPPED, GUARD_EMPTY_LOSS),
            # its probe rounds are cheap (one empty ends it) and say little each
            MATCH: KindRate(
                GUARD_PROBE_MATCH, on_margin=GUARD_MATCH_ON_MARGIN, ramp=GUARD_MATCH_RAMP
            ),
            CORPUS: KindRate(
                GUARD_PROBE_MATCH, 0.0, GUARD_CORPUS_ON_MARGIN, GUARD_CORPUS_ROUNDS, None
            ),
        }
        self.corpus = UNCAPPED  # what `caps` allows a corpus's proposal this round
        self.plain: deque[float] = deque(maxlen=GUARD_PLAIN_KEPT)  # seconds of plain rounds
        self._since_plain = 0  # rounds since the last plain one
        self._row_rounds = 0  # of the current row

    @property
    def plain_rate(self) -> float | None:
        """Tokens per second of plain rounds (the median of the recent ones)."""
        if len(self.plain) < GUARD_PLAIN_SAMPLES:
            return None
        return 1.0 / max(statistics.median(self.plain), 1e-9)

    def new_row(self) -> None:
        """A row starts: a kind that is off is probed early in it (`GUARD_ROW_PROBE`), unless
        it was already."""
        self._row_rounds = 0
        for kind in self.kinds.values():  # one probing as the row starts counts as its probe
            kind.probed_this_row = kind.state in ("probe", "judge")
            kind.read_row = False

    def caps(self) -> tuple[int, int]:
        """The most tokens this round may draft with the model, and verify of a match (0:
        none); of a corpus's proposal: ``self.corpus``. None where plain rounds must be timed
        first (a probe waits for its verdict) or again (`GUARD_PLAIN_EVERY`)."""
        baseline = self.plain_rate
        for kind in self.kinds.values():
            if kind.state == "judge" and baseline is not None:
                kind.judge(baseline)
            row_probe = self._row_rounds == GUARD_ROW_PROBE and not kind.probed_this_row
            if kind.state == "off" and (kind.off_for >= kind.wait or row_probe):
                kind.start_probe()
        waiting = any(kind.state == "judge" for kind in self.kinds.values())
        if waiting or self._since_plain >= GUARD_PLAIN_EVERY:
            self.corpus = 0
            return 0, 0
        self.corpus = self.kinds[CORPUS].cap
        return self.kinds[MODEL].cap, self.kinds[MATCH].cap

    def probing(self, kind: str) -> bool:
        """Whether ``kind``'s rounds now are a probe's (capped at its probe's tokens)."""
        return self.kinds[kind].state == "probe"

    def copy_probe(self) -> bool:
        """Whether matches, held off, may be probed now because the row seems to copy itself
        (`LonePlanner`): at most once every `GUARD_COPY_SPACING` rounds off."""
        kind = self.kinds[MATCH]
        if kind.state != "off" or kind.off_for < GUARD_COPY_SPACING:
            return False
        kind.start_probe()
        return True

    def observe(self, kind: str, tokens: int, seconds: float, catch_up_s: float = 0.0) -> None:
        """A round of ``kind`` (`MODEL`, `MATCH`, `CORPUS` or `PLAIN`) emitted ``tokens`` in
        ``seconds``, everything it did included; ``catch_up_s`` of them the draft reading
        what it had not seen (`KindRate.add`)."""
        self._row_rounds += 1
        self._since_plain = 0 if kind == PLAIN else self._since_plain + 1
        if kind == PLAIN:
            self.plain.append(seconds)
        baseline = self.plain_rate
        for name, other in self.kinds.items():
            if name == kind:
                other.add(tokens, seconds, catch_up_s)
                if other.state == "on" and other.rounds >= other.min_rounds and baseline:
                    other.judge(baseline)
            elif other.state == "off":
                other.off_for += 1

"""An audit of losslessness on a user's own bundle (`specrt verify`): does speculative decoding
give the target's own output here, with these settings?

- **Greedy identity**: each prompt's greedy output with the speculative settings equals the
  target alone's (``num_draft_tokens=0``), token for token: all prompts in one batch (rows
  sharing every call, each keeping its own number of draft tokens) and one at a time (the lone
  row's planner: its schedule, hybrid choice and guard).
- **Seeded identity**: the same under a seed, sampled: a seeded row's tokens are the target
  alone's draws under that seed (`sampling.KeyedDraws`).
- **Sampled law**: unseeded rows are verified by rejection sampling, whose output follows the
  target's warped distribution in law only. The first new token comes from the target's prompt
  pass, the second from the first verified round, so the law of the pair ``(t1, t2)`` is
  computed exactly from the target alone (its logits after the prompt and after prompt + t1,
  warped as the runtime warps them, under its logits processors and a structured output's
  grammar) and ``samples`` draws of the pair are tested against it
  (Pearson's chi-square, small cells pooled). A correct runtime fails it with probability
  ``alpha``, the false-alarm rate.

The sampled checks draft every round: any schedule but ``"fixed"`` is replaced by it, since
in a batch of sampled rows the load schedule chooses instead, and it may draft nothing where
drafting does not pay (as it did for ``"heuristic"`` on a busy host).
A schedule chooses only how many tokens are drafted, never which are kept, and a check that
verified no draft token would audit nothing. Each line says how many draft tokens were verified.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specrt.backends import Decoder
from specrt.errors import InvalidInputError, NumericalError
from specrt.runtime.batching import Request
from specrt.runtime.chi_square import MIN_EXPECTED, Fit, goodness_of_fit
from specrt.runtime.config import GenerationConfig, SamplingParams
from specrt.runtime.generator import Prompt, SpeculativeGenerator, row_rng
from specrt.runtime.grammar import row_grammar
from specrt.runtime.processors import LogitsProcessors
from specrt.runtime.results import GenerationResult
from specrt.runtime.sampling import LOOP_DTYPE, warp
from specrt.validation import integer, number

# Short, generic prompts (code and prose) for any model; one repeats itself, so that prompt
# lookup has matches to propose. The first two (where the sampled law is tested) are code: on
# the demo pair a wrong rejection rule showed most there, the prose prompts least.
DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "The capital of France is",
    "Once upon a time, there was a",
    "for i in range(10):\n    for j in range(10):\n",
    "one, two, three, one, two, three, one, two,",
)
DEFAULT_SAMPLES = 2000
DEFAULT_ALPHA = 0.001
DEFAULT_TEMPERATURE = 0.8  # the sampled checks' where the config is greedy
DEFAULT_SEED = 0  # the seeded check's where the config has none
DEFAULT_LAW_PROMPTS = 2
MIN_SAMPLES = 100  # fewer leave every cell below 5 expected: a test of nothing
AUDIT_BATCH = 16  # rows per call when `audit` loads the bundle itself


@dataclass(frozen=True)
class CheckResult:
    """One check: its name, whether it passed, and what it measured (the numbers).
    ``tested`` False: it could not test anything (its samples make one cell, or no draft token
    was verified), which is no pass."""

    name: str
    passed: bool
    detail: str
    tested: bool = True

    def __str__(self) -> str:
        verdict = "NOT TESTED" if not self.tested else "PASS" if self.passed else "FAIL"
        return f"{self.name}: {self.detail} {verdict}"


# A sampled-law check's progress: (its name, rows done, rows in all), after each row ends
Progress = Callable[[str, int, int], None]


def audit(
    bundle: str | Path | SpeculativeGenerator,
    prompts: Sequence[Prompt] | None = None,
    samples: int = DEFAULT_SAMPLES,
    config: GenerationConfig | None = None,
    alpha: float = DEFAULT_ALPHA,
    law_prompts: int = DEFAULT_LAW_PROMPTS,
    progress: Progress | None = None,
) -> list[CheckResult]:
    """Every check's result (see `run_checks`)."""
    return list(run_checks(bundle, prompts, samples, config, alpha, law_prompts, progress))


def run_checks(
    bundle: str | Path | SpeculativeGenerator,
    prompts: Sequence[Prompt] | None = None,
    samples: int = DEFAULT_SAMPLES,
    config: GenerationConfig | None = None,
    alpha: float = DEFAULT_ALPHA,
    law_prompts: int = DEFAULT_LAW_PROMPTS,
    progress: Progress | None = None,
) -> Iterator[CheckResult]:
    """Audit ``bundle`` (a path, loaded with `AUDIT_BATCH` rows per call, or a loaded
    generator, which no other thread may use meanwhile) with ``config``'s drafting (proposer,
    K, schedule, n-gram range) and sampling (temperature, top-k, top-p; `DEFAULT_TEMPERATURE`
    where greedy) on ``prompts`` (default `DEFAULT_PROMPTS`), yielding each check as it ends:
    greedy identity and seeded identity (``config.max_new_tokens`` tokens a prompt; seed
    ``config.seed``, else `DEFAULT_SEED`), then the sampled law of the first two new tokens
    of each of the first ``law_prompts`` prompts, ``samples`` draws each, at false-alarm rate
    ``alpha``; ``progress`` is told of the sampled rows as each batch of them ends (they are
    most of the time on a larger target)."""
    samples = integer("samples", samples, MIN_SAMPLES)
    alpha = number("alpha", alpha, "use a number in (0, 1)", lambda a: 0 < a < 1)
    law_prompts = integer("law_prompts", law_prompts, 0)
    if isinstance(prompts, (str, bytes)):  # it was audited as prompts of one character each
        raise InvalidInputError("prompts must be a list of prompts, not one string: give [prompt]")
    config = GenerationConfig() if config is None else config
    if not isinstance(config, GenerationConfig):
        raise InvalidInputError(f"config must be a GenerationConfig, not {type(config).__name__}")
    if not config.num_draft_tokens:
        raise InvalidInputError(
            "num_draft_tokens=0 runs the target alone: nothing to verify; give at least 1"
        )
    if isinstance(bundle, SpeculativeGenerator):
        generator = bundle
    else:
        generator = SpeculativeGenerator.from_bundle(bundle, max_batch=AUDIT_BATCH)
    ids = generator.encode_prompts(list(DEFAULT_PROMPTS if prompts is None else prompts))

    # Every row runs to max_new_tokens: more tokens compared, and the pair's law is defined
    # (a structured output's answer ends with EOS where its grammar is complete)
    config = replace(config, ignore_eos=config.structured_output is None, stop=())
    greedy = replace(config, temperature=0.0, seed=None)
    yield from _identity("greedy identity", generator, ids, greedy)
    sampled = sampled_config(config)
    name = f"seeded identity (temperature {sampled.temperature:g}, seed {sampled.seed})"
    yield from _identity(name, generator, ids, sampled)
    # K + 2 new tokens: after t1, room for a whole round of K drafts (a round emits one more)
    unseeded = replace(sampled, seed=None, max_new_tokens=sampled.num_draft_tokens + 2)
    for index in range(min(law_prompts, len(ids))):
        yield _law(generator, index, ids[index], unseeded, samples, alpha, progress)


def sampled_config(config: GenerationConfig) -> GenerationConfig:
    """The sampled checks' settings: ``config``'s, at `DEFAULT_TEMPERATURE` where it is
    greedy, seeded (`DEFAULT_SEED` where it has no seed), drafting every round (see the
    module)."""
    sampled = config
    if config.greedy:
        sampled = replace(sampled, temperature=DEFAULT_TEMPERATURE)
    if sampled.seed is None:
        sampled = replace(sampled, seed=DEFAULT_SEED)
    if sampled.draft_schedule != "fixed":
        sampled = replace(sampled, draft_schedule="fixed")
    return sampled


# Identity -------------------------------------------------------------------------------------
def _identity(
    name: str, generator: SpeculativeGenerator, ids: list[list[int]], config: GenerationConfig
) -> Iterator[CheckResult]:
    """``config``'s output against the target alone's, all prompts in one batch, then one at a
    time (a generator of one row per call runs them one at a time either way)."""
    reference = _outputs(generator, ids, replace(config, num_draft_tokens=0), together=False)
    ways = ["one at a time"]
    if generator.max_batch > 1 and len(ids) > 1:
        ways.insert(0, f"in batches of up to {generator.max_batch} rows")
    for way in ways:
        results = _outputs(generator, ids, config, together=way != "one at a time")
        differ = [
            (index, alone, result)
            for index, (alone, result) in enumerate(zip(reference, results))
            if alone.token_ids != result.token_ids
        ]
        same = len(ids) - len(differ)
        detail = (
            f"{same}/{len(ids)} prompts identical to the target alone "
            f"({config.max_new_tokens} tokens each; {_drafts(results)})"
        )
        if differ:
            detail += "; " + _first_difference(*differ[0])
        # the target alone against itself tests nothing speculative: no pass (a difference
        # still fails: the runtime is then not even deterministic)
        tested = bool(differ) or _drafted(results)
        yield CheckResult(f"{name}, {way}", not differ, detail, tested)


def _outputs(
    generator: SpeculativeGenerator,
    ids: list[list[int]],
    config: GenerationConfig,
    together: bool,
) -> list[GenerationResult]:
    """Each prompt's result, row i on the stream ``row_rng(config, i)`` either way (so that a
    seeded row draws the same noise in a batch and alone)."""
    requests = [Request(i, prompt, config, row_rng(config, i)) for i, prompt in enumerate(ids)]
    results: dict = {}
    for batch in [requests] if together else [[request] for request in requests]:
        results.update(generator.run(batch))
    for result in results.values():
        if result.error is not None:
            raise NumericalError(result.error)
    return [results[i] for i in range(len(ids))]


def _drafted(results: Sequence[GenerationResult]) -> int:
    return sum(result.stats.drafted_tokens for result in results)


def _drafts(results: Sequence[GenerationResult]) -> str:
    drafted = _drafted(results)
    accepted = sum(result.stats.accepted_tokens for result in results)
    if not drafted:
        return (
            "no draft token verified, so nothing speculative is tested: give more "
            "--max-new-tokens, or a proposer that drafts on these prompts"
        )
    return f"{accepted} of {drafted} draft tokens kept"


def _first_difference(index: int, alone: GenerationResult, result: GenerationResult) -> str:
    ours, theirs = result.token_ids, alone.token_ids
    at = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs))
    )
    got = ours[at] if at < len(ours) else "end"
    wanted = theirs[at] if at < len(theirs) else "end"
    return f"prompt {index + 1} first differs at new token {at + 1} ({got}, target alone {wanted})"


# The sampled law ------------------------------------------------------------------------------
def _law(
    generator: SpeculativeGenerator,
    index: int,
    prompt: list[int],
    config: GenerationConfig,
    samples: int,
    alpha: float,
    progress: Progress | None = None,
) -> CheckResult:
    """``samples`` unseeded rows of ``prompt`` in batches; their first two new tokens against
    the target's exact law of that pair."""
    name = f"sampled law, prompt {index + 1}"
    ordered = _first_two(generator, prompt, config, samples, name, progress)
    for result in ordered:
        if result.error is not None:
            raise NumericalError(result.error)
        if len(result.token_ids) < 2:  # the model's max positions reached
            raise InvalidInputError(
                f"prompt {index + 1} leaves room for fewer than 2 new tokens: shorten it"
            )
    pairs = np.array([result.token_ids[:2] for result in ordered], dtype=np.int64)
    eos, vocab = generator.eos_token_ids, generator.target.vocab_size
    grammar = row_grammar(config, generator.tokenizer, eos, vocab)  # follows each context
    processors = config.processors_for(eos, grammar)
    fit = _pair_fit(generator.target, prompt, pairs, config.sampling, processors)
    detail = (
        f"chi-square p={fit.pvalue:.3g} over {samples} samples of the first two new tokens "
        f"({fit.cells} cells; {_drafts(ordered)}; false-alarm rate {alpha:g})"
    )
    if fit.impossible:
        detail = (
            f"a sampled pair of first tokens has probability 0 under the target "
            f"({samples} samples; {_drafts(ordered)})"
        )
    elif fit.cells < 2:  # every sample in one cell fits any law: p = 1 says nothing
        detail = (
            f"the {samples} samples of the first two new tokens make one cell of the target's "
            "law (too few to tell laws apart): give more --samples, or another prompt"
        )
        if config.sampling.top_k == 1:  # one outcome whatever the number of samples
            detail = "top-k 1 leaves one token a step, a law of one outcome: give a larger --top-k"
        return CheckResult(name, True, detail, tested=False)
    passed = fit.pvalue >= alpha  # a failure stands with or without drafts: the sampler's
    return CheckResult(name, passed, detail, tested=not passed or _drafted(ordered) > 0)


def _first_two(
    generator: SpeculativeGenerator,
    prompt: list[int],
    config: GenerationConfig,
    samples: int,
    name: str,
    progress: Progress | None,
) -> list[GenerationResult]:
    """``samples`` rows of ``prompt``, a batch at a time through the generator's own runner,
    each stopped once it has two new tokens: the first round decides the second, and the
    rounds after it (most of a row's time) would change nothing tested."""
    results: list[GenerationResult] = []
    with generator._owned():
        runner = generator.runner()
        while len(results) < samples:
            count = min(runner.max_batch, samples - len(results))
            batch = [Request(len(results) + i, prompt, config) for i in range(count)]
            done = [result for _, result in runner.add(batch)]
            while any(len(tokens) < 2 for _, tokens, _ in runner.active()):
                done += [result for _, result in runner.step()]
            done += [runner.cancel(request.key) for request, *_ in list(runner.active())]
            results += done
            if progress is not None:
                progress(name, len(results), samples)
    return results


def _pair_fit(
    target: Decoder,
    prompt: list[int],
    pairs: np.ndarray,
    sampling: SamplingParams,
    processors: LogitsProcessors | None = None,
) -> Fit:
    """The chi-square fit of ``pairs [N, 2]`` to the target's law of (t1, t2) after ``prompt``.

    Cells are fixed before looking at the samples: a pair (t1, t2) for every t1 expected at
    least `MIN_EXPECTED` times, then one cell for every other t1 (a pair can only be expected
    that often if its t1 is), pooled further by `goodness_of_fit`. Every sampled pair is also
    checked to be possible (probability > 0 under top-k / top-p)."""
    n, vocab = len(pairs), target.vocab_size
    first, conditional = _target_law(target, prompt, pairs[:, 0], sampling, n, processors)
    frequent = np.flatnonzero(first * n >= MIN_EXPECTED)
    observed, expected = [], []
    for t1 in frequent.tolist():
        seconds = pairs[pairs[:, 0] == t1, 1]
        observed.append(np.bincount(seconds, minlength=vocab))
        expected.append(n * first[t1] * conditional[t1])
    rest = ~np.isin(pairs[:, 0], frequent)
    observed.append(np.array([rest.sum()]))
    expected.append(np.array([n * max(0.0, 1.0 - float(first[frequent].sum()))]))
    impossible = any(
        first[t1] == 0 or conditional[t1][t2] == 0 for t1, t2 in {tuple(p) for p in pairs.tolist()}
    )
    fit = goodness_of_fit(np.concatenate(observed), np.concatenate(expected))
    return replace(fit, pvalue=0.0, impossible=True) if impossible else fit


def _target_law(
    target: Decoder,
    prompt: list[int],
    firsts: np.ndarray,
    sampling: SamplingParams,
    samples: int,
    processors: LogitsProcessors | None = None,
) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """The target's warped distribution of t1 after ``prompt``, and of t2 after prompt + t1
    for each t1 sampled or expected at least `MIN_EXPECTED` times in ``samples``: the prompt
    fed once, then each t1 after it (the cache rolled back to the prompt in between). The
    warp is the runtime's own, in its dtype, so top-k and top-p cut where the runtime does;
    so are the logits processors (t1 counted as generated)."""

    def law(logits: np.ndarray, context: list[int]) -> np.ndarray:
        if processors is not None:
            logits = np.array(logits[None], dtype=np.float32)
            logits = processors.apply(logits, context, len(prompt), [])[0]
        s = sampling
        p = warp(logits, s.temperature, s.top_k, s.top_p, target.role, LOOP_DTYPE, s.min_p)
        p = p.astype(np.float64)
        return p / p.sum()

    target.reset()
    try:
        first = law(target.forward(prompt, keep_last=1).logits[-1], prompt)
        wanted = set(np.flatnonzero(first * samples >= MIN_EXPECTED).tolist())
        wanted |= set(np.unique(firsts).tolist())
        conditional = {}
        for t1 in sorted(wanted):
            target.rollback(len(prompt))
            conditional[t1] = law(target.forward([t1], keep_last=1).logits[-1], [*prompt, t1])
    finally:
        target.reset()  # the runner sets each slot's length as it admits a row; clean anyway
    return first, conditional

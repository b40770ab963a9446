"""The generator: rows of prompts through prefill and speculative rounds, with stats."""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from specrt.backends import Decoder
from specrt.backends.one_row import as_rows
from specrt.errors import InvalidInputError, NumericalError, PromptTooLongError
from specrt.runtime.batching import BatchRunner, Request
from specrt.runtime.config import GenerationConfig
from specrt.runtime.corpus import CorpusTable
from specrt.runtime.hybrid import HybridChoice
from specrt.runtime.loading import ModelPair, load_pair
from specrt.runtime.lookup import SuffixCache
from specrt.runtime.prefixes import KeptRows
from specrt.runtime.requests import LoneLearners, token_ids
from specrt.runtime.results import GenerationResult
from specrt.runtime.schedules import DraftSchedule, LoadSchedule, make_schedule
from specrt.runtime.schedules.guard import SpeculationGuard
from specrt.runtime.tokenizer import BundleTokenizer

Prompt = str | Sequence[int]
# How many times a token's longest text a prompt may hold per position before it is refused
# untokenized (a normalizer may merge characters: NFC, collapsed spaces).
PROMPT_CHARS_MARGIN = 8


class SpeculativeGenerator:
    """Generates with a target model, sped up by a draft model and matching; output as the
    target's.

    Every call runs the one round engine (`specrt.runtime.batching`): loaded with
    ``max_batch`` > 1 (batched engines), up to that many rows share every model call;
    otherwise a lone row is a batch of one. The models' caches and output arrays belong to the
    generator: a lock serialises calls from several threads (load one generator per thread to
    run them in parallel), and while a `Service` runs on it, they are the service's (submit
    to it)."""

    def __init__(
        self,
        target: Decoder,
        draft: Decoder,
        tokenizer: BundleTokenizer | None = None,
        eos_token_ids: Sequence[int] = (),
        suffix_cache: SuffixCache | None = None,
        corpus: CorpusTable | None = None,
    ) -> None:
        if suffix_cache is not None and not isinstance(suffix_cache, SuffixCache):
            raise InvalidInputError(
                f"suffix_cache must be a SuffixCache or None, not {type(suffix_cache).__name__} "
                "(load options such as engine= are keywords)"
            )
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        # Off unless given: it shares one request's text with the proposals of the next.
        self.suffix_cache = suffix_cache
        self.corpus = corpus  # the bundle's (`load_pair`): static, shared by every request
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread in a call that holds the caches
        self._service: weakref.ref | None = None  # the Service running on them, if any
        self._schedules: dict[tuple[str, int, bool], DraftSchedule] = {}
        self._hybrids: dict[tuple[int, int, bool, bool], HybridChoice] = {}
        self._guards: dict[tuple, SpeculationGuard] = {}
        self._load_schedules: dict[str, LoadSchedule] = {}  # what batches learn, kept
        # The round engine runs rows: a one-row decoder is rows of one
        self.rows_decoders = as_rows(target), as_rows(draft)

    @classmethod
    def from_bundle(
        cls, bundle_dir: str | Path, suffix_cache: SuffixCache | None = None, **options: Any
    ) -> SpeculativeGenerator:
        """Load a bundle (``options``: those of `specrt.runtime.loading.load_pair`)."""
        known = list(inspect.signature(load_pair).parameters)[1:]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise InvalidInputError(
                f"from_bundle got unknown option(s) {unknown}; it takes suffix_cache, "
                + ", ".join(known)
            )
        return cls.from_pair(load_pair(bundle_dir, **options), suffix_cache)

    @classmethod
    def from_pair(
        cls, pair: ModelPair, suffix_cache: SuffixCache | None = None
    ) -> SpeculativeGenerator:
        return cls(
            pair.target, pair.draft, pair.tokenizer, pair.eos_token_ids, suffix_cache, pair.corpus
        )

    @property
    def max_batch(self) -> int:
        """Rows that run together (1 unless both models are batched engines loaded so)."""
        target, draft = self.rows_decoders
        return min(target.max_batch, draft.max_batch)

    @property
    def model_time_s(self) -> float:
        """Total time spent running the models so far (the rest is the loop's overhead)."""
        return self.target.run_time_s + self.draft.run_time_s

    # ----------------------------------------------------------------------------------------
    def check_config(self, config: GenerationConfig) -> None:
        """Refuse, before any work, what this bundle cannot do with ``config``: stop strings
        or structured output without its tokenizer, a logit_bias for a token past its
        vocabulary."""
        if config.stop and self.tokenizer is None:
            raise InvalidInputError("stop strings need the bundle's tokenizer", "stop")
        if config.structured_output and (self.tokenizer is None or not self.eos_token_ids):
            message = "structured output needs the bundle's tokenizer and an EOS token to end with"
            raise InvalidInputError(message, "structured_output")
        if config.structured_output:  # read once, here: a tokenizer it cannot read says so now
            self.tokenizer.guidance(tuple(sorted(self.eos_token_ids)), self.target.vocab_size)
        vocab = self.target.vocab_size
        if config.logit_bias and config.logit_bias[-1][0] >= vocab:
            raise InvalidInputError(
                f"logit_bias names token {config.logit_bias[-1][0]}, past this model's "
                f"vocabulary (ids 0 to {vocab - 1})",
                "logit_bias",
            )

    def encode_prompts(
        self, prompts: Sequence[Prompt], config: GenerationConfig | None = None
    ) -> list[list[int]]:
        """Tokenize and check every prompt before any work starts (cut as ``config``'s
        ``truncate_prompt_tokens`` asks)."""
        if isinstance(prompts, (str, bytes, dict)) or not isinstance(prompts, Sequence):
            raise InvalidInputError(
                "prompts must be a list of prompts (strings or lists of token ids), not "
                f"{type(prompts).__name__}"
            )
        if len(prompts) == 0:
            raise InvalidInputError("no prompts given")
        encoded = []
        for index, prompt in enumerate(prompts):
            name = "the prompt" if len(prompts) == 1 else f"prompt {index + 1} of {len(prompts)}"
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise InvalidInputError("this generator has no tokenizer; pass token ids")
                if len(prompt) > self.max_prompt_chars:  # found without tokenizing it all
                    raise PromptTooLongError(
                        f"{name} has {len(prompt)} characters, far more than "
                        f"{self.target.max_positions} positions hold (a token stands for at "
                        f"most {self.tokenizer.max_token_chars} characters here); shorten it"
                    )
                try:
                    ids = self.tokenizer.encode(prompt)
                except InvalidInputError as exc:  # which of many prompts it is
                    if len(prompts) == 1:
                        raise
                    message = str(exc).replace("the prompt", name, 1)
                    named = message if name in message else f"{name}: {exc}"
                    raise InvalidInputError(named) from exc
            else:
                ids = token_ids(name, prompt, self.target.vocab_size)
            if config is not None:
                ids = config.kept_prompt(ids, self.target.max_positions)
            if len(ids) >= self.target.max_positions:
                raise PromptTooLongError(self._too_long(name, len(ids)))
            encoded.append(ids)
        return encoded

    @property
    def max_prompt_chars(self) -> int:
        """Characters beyond which a prompt cannot fit, whatever its tokens: a token stands for
        `BundleTokenizer.max_token_chars` at most (`PROMPT_CHARS_MARGIN` times over, for
        normalizers that merge characters). A longer prompt is refused before it is tokenized,
        which takes seconds for megabytes of text."""
        per_token = self.tokenizer.max_token_chars if self.tokenizer is not None else 1
        return PROMPT_CHARS_MARGIN * self.target.max_positions * per_token

    def _too_long(self, name: str, length: int) -> str:
        limit, own = self.target.max_positions, self.target.model_max_positions
        message = (
            f"{name} has {length} tokens; at most {limit} positions fit, which leaves no "
            f"room to generate. Shorten it to at most {limit - 1} tokens"
        )
        if limit < own:
            return (
                message + f" or load with a larger max length (--max-length; the model has {own})"
            )
        return message + " (the model's own limit)"

    def generate(
        self, prompts: Sequence[Prompt], config: GenerationConfig | None = None
    ) -> list[GenerationResult]:
        """Generate for each prompt (a string or token ids), results in the prompts' order.
        With ``max_batch`` > 1 the rows share every model call (up to that many at a time);
        else they run one after another."""
        return list(self.stream(prompts, config))

    def stream(
        self, prompts: Sequence[Prompt], config: GenerationConfig | None = None
    ) -> Iterator[GenerationResult]:
        """Like `generate`, yielding each row's result in order as soon as it is done. A
        stream holds the generator (its rows are in the caches) until it is read to the end
        or closed: other threads' calls wait for it meanwhile."""
        if config is None:
            config = GenerationConfig()
        elif not isinstance(config, GenerationConfig):
            raise InvalidInputError(
                f"config must be a GenerationConfig, not {type(config).__name__} (build one "
                "with GenerationConfig(max_new_tokens=..., ...))"
            )
        self.check_config(config)
        return self._rows(self.encode_prompts(prompts, config), config)

    def _rows(
        self, encoded: list[list[int]], config: GenerationConfig
    ) -> Iterator[GenerationResult]:
        """The rows' results in the prompts' order (rows of a batch finish out of order). With
        one row per call, each row is a call of its own: the generator is free between rows,
        so other threads' calls (and calls made while reading the stream) need not wait for
        the whole stream."""
        requests = [Request(i, ids, config, row_rng(config, i)) for i, ids in enumerate(encoded)]
        if self.max_batch == 1:
            for request in requests:
                [(_, result)] = list(self.run([request]))
                if result.error is not None:  # NaN/inf logits: generate() raises
                    raise NumericalError(result.error)
                yield result
            return
        done: dict[int, GenerationResult] = {}
        results = self.run(requests)
        for row in range(len(encoded)):
            while row not in done:
                key, result = next(results)
                if result.error is not None:  # NaN/inf logits: generate() raises
                    raise NumericalError(result.error)
                done[key] = result
            yield done.pop(row)

    def run(self, requests: Iterable[Request]) -> Iterator[tuple[Hashable, GenerationResult]]:
        """Generate each `Request` (its prompt checked by `encode_prompts`, its own config and
        random stream), yielding ``(request.key, result)`` as rows finish: up to
        ``max_batch`` at a time, finishing out of order (a lone request is a batch of one). A
        row whose logits come out NaN/inf ends alone, as a result with ``error`` set (finish
        reason "error"): the other rows go on. Keys tell the results apart, so one met again
        is refused (as vLLM refuses a request id in use), and the rows before it go on."""
        if isinstance(requests, Request) or not isinstance(requests, Iterable):
            raise InvalidInputError(
                f"run() takes an iterable of Requests (a list of one for one), not "
                f"{type(requests).__name__}"
            )
        return self._run(requests)

    def _run(self, requests: Iterable[Request]) -> Iterator[tuple[Hashable, GenerationResult]]:
        keys: set = set()

        def checked(request: Request) -> Request:
            request = self._checked(request)
            try:
                seen = request.key in keys
            except TypeError:  # unhashable: no result could be matched to it
                raise InvalidInputError(
                    f"request key {request.key!r} is not hashable: use a str or an int"
                ) from None
            if seen:
                raise InvalidInputError(
                    f"request key {request.key!r} appears twice in one run(): give each "
                    "request its own key, which its result is yielded with"
                )
            keys.add(request.key)
            return request

        with self._owned():
            yield from self.runner().run(map(checked, requests))

    def runner(self) -> BatchRunner:
        """A runner over this generator's caches, keeping what its schedules learn."""
        target, draft = self.rows_decoders
        runner = BatchRunner(
            target,
            draft,
            self.tokenizer,
            self.eos_token_ids,
            self.suffix_cache,
            self.one_row,
            self.corpus,
        )
        runner.schedules = self._load_schedules
        return runner

    def _checked(self, request: Request) -> Request:
        """A `Request` made by hand, checked as cheaply as a batch job's rows allow: its
        config, random stream and prompt (token ids in the vocabulary, room left to
        generate); a bad one would fail inside the model call, or end with no tokens."""
        name = f"request {getattr(request, 'key', '?')!r}"
        if not isinstance(request, Request):
            raise InvalidInputError(f"run() takes Requests, not {type(request).__name__}")
        if not isinstance(request.config, GenerationConfig):
            raise InvalidInputError(f"{name}: config must be a GenerationConfig")
        if not isinstance(request.rng, np.random.Generator):
            raise InvalidInputError(f"{name}: rng must be a numpy Generator (row_rng)")
        try:
            self.check_config(request.config)
        except InvalidInputError as exc:  # which of the run's requests it is
            raise InvalidInputError(f"{name}: {exc}", exc.field) from None
        request = request.fresh()
        if isinstance(request.prompt, str):
            try:
                [tokens] = self.encode_prompts([request.prompt], request.config)
            except InvalidInputError as exc:  # which of the run's requests it is
                raise type(exc)(f"{name}: {exc}") from None
            request = replace(request, prompt=tokens)
        elif isinstance(request.prompt, (list, tuple, np.ndarray)):
            kept = request.config.kept_prompt(request.prompt, self.target.max_positions)
            request = replace(request, prompt=kept)
        ids = np.asarray(request.prompt)
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
            raise InvalidInputError(f"{name}: its prompt must be a non-empty list of token ids")
        if ids.min() < 0 or ids.max() >= self.target.vocab_size:
            raise InvalidInputError(
                f"{name}: its prompt has token ids outside the vocabulary "
                f"[0, {self.target.vocab_size})"
            )
        if len(ids) >= self.target.max_positions:
            raise PromptTooLongError(self._too_long(f"the prompt of {name}", len(ids)))
        return request

    @contextlib.contextmanager
    def _owned(self) -> Iterator[None]:
        """Hold the caches for a call: other threads wait their turn. Refused, saying why: a
        call while a `Service` runs on this generator (it would overwrite the rows of the
        service's requests between two of its rounds), and one that could only wait for
        itself (a partly read `stream` or `run` of this thread)."""
        if self._holder == threading.get_ident():
            raise InvalidInputError(
                "a stream of this generator is still open in this thread (a partly read "
                "stream() or run() holds its rows): read it to the end or "
                "close() it first"
            )
        self._refuse_if_serving()  # not waited for: a service's done callback would wait forever
        with self._lock:  # a Service started while this call waited for the lock counts too
            self._refuse_if_serving()
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    def _refuse_if_serving(self) -> None:
        if self._service is not None and self._service() is not None:
            raise InvalidInputError(
                "this generator runs a Service, whose requests its caches hold: submit this "
                "one to the service (service.submit), close it first, or load another generator"
            )

    def _serve(self, service: object | None) -> None:
        """Hand the caches to ``service`` (None: back to direct calls); one at a time."""
        if service is not None:
            if self._service is not None and self._service() is not None:
                raise InvalidInputError(
                    "this generator already runs a Service (its caches hold that service's "
                    "rows): submit to that one, close it first, or load another generator"
                )
            if self._holder is not None:
                raise InvalidInputError(
                    "this generator is in a call (another thread's, or a stream() or run() "
                    "not read to the end): finish it before starting a Service on it"
                )
        self._service = None if service is None else weakref.ref(service)

    def _schedule(self, config: GenerationConfig) -> DraftSchedule:
        """One per schedule, K limit and mode, kept across rows and calls: what it learns (the
        draft's calibration, the machine's costs) holds for the pair, not for one prompt."""
        drafts = config.num_draft_tokens and config.proposer != "lookup"  # a match has no cost
        name = config.draft_schedule if drafts else "fixed"
        # Seeded rows' drafts are kept less often (`KeyedDraws`): learnt apart
        key = (name, config.num_draft_tokens, config.greedy, config.reproducible)
        if key not in self._schedules:
            even_rows = getattr(getattr(self.target, "spec", None), "even_rows", False)
            self._schedules[key] = make_schedule(name, config.num_draft_tokens, even_rows)
        return self._schedules[key]

    def forget_kept_rows(self) -> None:
        """Give up the finished rows kept for prompts that begin alike (`prefixes.KeptRows`):
        the next calls read their prompts whole, as a fresh process's do (what timing one
        mode against another on the same prompts needs: else the second reads none)."""
        with self._owned():
            KeptRows.of(self.rows_decoders[0]).clear()

    def forget_learning(self) -> None:
        """Start the learners afresh (the schedules, the hybrid's rates, the guards), as in a
        new process: what they learnt of the pair, machine and text so far is dropped. The
        output never depends on them."""
        with self._owned():
            self._schedules.clear()
            self._hybrids.clear()
            self._guards.clear()
            self._load_schedules.clear()

    def one_row(self, config: GenerationConfig) -> LoneLearners:
        """What a row learns with in the rounds it runs alone (`BatchRunner`): the hybrid's
        choice (None unless its proposer is "hybrid"), the draft schedule and the guard against
        decoding slower than the target alone (None unless the schedule is "adaptive"). All
        are kept across rows, per the settings they learn under: what they learn holds for the
        pair and machine, not one prompt."""
        key = (
            config.prompt_lookup_min,
            config.prompt_lookup_max,
            config.greedy,
            config.reproducible,
        )
        hybrid = None
        if config.proposer == "hybrid":
            hybrid = self._hybrids.get(key)
            if hybrid is None:
                even_rows = getattr(getattr(self.target, "spec", None), "even_rows", False)
                hybrid = self._hybrids[key] = HybridChoice(even_rows=even_rows)
        guard = None
        if config.draft_schedule == "adaptive":
            key = (config.proposer, config.num_draft_tokens, *key)  # what it times differs
            guard = self._guards.get(key)
            if guard is None:
                guard = self._guards[key] = SpeculationGuard()
        return LoneLearners(hybrid, self._schedule(config), guard)


def row_rng(config: GenerationConfig, row: int) -> np.random.Generator:
    """Row ``row``'s own random stream: keyed by (seed, row) under a seed, else fresh."""
    return np.random.default_rng(None if config.seed is None else [config.seed, row])

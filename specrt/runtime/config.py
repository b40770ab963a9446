"""Generation parameters, named as in transformers and vLLM, validated in one place."""

from __future__ import annotations

import difflib
import functools
import warnings
from dataclasses import dataclass, fields

from specrt.errors import InvalidInputError, UnknownSettingError
from specrt.runtime.grammar import GrammarState
from specrt.runtime.logprobs import MAX_LOGPROBS
from specrt.runtime.processors import LogitsProcessors
from specrt.structured import StructuredOutput
from specrt.validation import flag, integer, number, out_of_range

MAX_DRAFT_TOKENS = 64
DRAFT_SCHEDULES = ("fixed", "adaptive", "heuristic")
PROPOSERS = ("model", "lookup", "hybrid")
MAX_NGRAM = 16


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a token, the part of `GenerationConfig` the draft steps and the verifier
    need: ``temperature`` 0 is greedy; ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 switch those
    filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def identity_warp(self) -> bool:
        """Sampling from the model's own distribution (temperature 1, no filters): a graph's
        softmax output can be used as it is."""
        return self.temperature == 1 and self.top_k == 0 and self.top_p == 1 and self.min_p == 0


# What users of the tools they know write for our settings: named in the refusal
OTHER_NAMES = {
    "max_tokens": "max_new_tokens",  # OpenAI, vLLM's SamplingParams
    "num_speculative_tokens": "num_draft_tokens",  # vLLM
    "num_assistant_tokens": "num_draft_tokens",  # transformers
    "num_assistant_tokens_schedule": "draft_schedule",  # transformers
    "do_sample": "temperature (0 is greedy, > 0 samples)",  # transformers
    "stop_strings": "stop",  # transformers
    "prompt_lookup_num_tokens": 'proposer="lookup" with num_draft_tokens',  # transformers
}


def _known_settings_only(cls: type) -> type:
    """Refuse an unknown keyword saying what to write instead (the dataclass's own TypeError
    names the keyword alone)."""
    init = cls.__init__
    names = [f.name for f in fields(cls) if f.init]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:  # noqa: N807
        for key in kwargs:
            if key not in names:
                offered = [n for n in names if n != "adaptive_draft"]  # deprecated
                close = difflib.get_close_matches(key, offered, 1)  # as recipes' keys are
                if key in OTHER_NAMES:
                    hint = f"use {OTHER_NAMES[key]}"
                elif close:
                    hint = f"did you mean {close[0]!r}?"
                else:
                    hint = f"its settings are {', '.join(offered)}"
                raise UnknownSettingError(
                    f"GenerationConfig has no setting {key!r}: {hint}", field=key
                )
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


@_known_settings_only
@dataclass(frozen=True)
class GenerationConfig:
    """What to generate and how. The defaults are those of the CLI and the server too: the
    hybrid proposer with the adaptive schedule, K at most 4, measured fastest on held-out text
    (docs/performance.md).

    ``draft_schedule``: ``"fixed"`` drafts ``num_draft_tokens`` every round; ``"adaptive"``
    stops a round's drafting when one more token no longer pays for its time (from the draft's
    confidence, the acceptance seen so far and the measured costs); ``"heuristic"`` is the
    classic +2 after a fully accepted round, -1 otherwise (transformers' schedule). Both are
    capped at ``num_draft_tokens``; the output is the same either way. ``adaptive_draft=True``
    (deprecated, with a warning) sets ``draft_schedule="adaptive"``.
    ``temperature == 0`` means greedy decoding, as in transformers and vLLM. ``top_k == 0``,
    ``top_p == 1`` and ``min_p == 0`` switch those filters off (``min_p``: tokens less likely
    than ``min_p`` times the most likely one are dropped, after top-p, as transformers' order).
    ``num_draft_tokens == 0`` runs the target alone: the baseline every comparison uses.
    ``seed`` makes sampling reproducible, bit for bit across calls and processes; row ``i`` of a
    batch uses the stream ``(seed, i)``, and a row's tokens are those the target alone samples under
    that seed (its draws are keyed by position, whatever is drafted: `sampling.KeyedDraws`), so the
    draft length, proposer and batch leave them as they are. ``stop``: strings (or one string) that
    end a row where its new text first contains one; the text stops before it
    (`specrt.runtime.stopping`). ``stop_token_ids``: tokens that end a row as EOS does (kept in its
    tokens; vLLM's), whether or not EOS is ignored.
    ``min_tokens`` (vLLM's): new tokens before which neither EOS nor a stop token can be
    drawn (their logits held at -inf); stop strings still end a row.
    ``structured_output`` (vLLM's ``structured_outputs``; a `StructuredOutput` or a dict of its
    fields): a JSON schema, any JSON object, a regex, choices or a Lark grammar the answer
    follows, ending with EOS where it is complete (`specrt.runtime.grammar`).
    ``logprobs``: the target's log-probability of each new token and of the ``logprobs``
    most likely tokens at its position (0: the chosen token's alone; None: none), its own
    distribution before temperature, top-k and top-p, as vLLM returns them
    (`GenerationResult.logprobs`). ``prompt_logprobs`` (vLLM's): the same for each prompt
    token after the first (`GenerationResult.prompt_logprobs`); the row then reads its whole
    prompt itself, whatever a cache holds of it.
    ``skip_special_tokens=False`` (vLLM's) writes special tokens into the text; the tokens are
    the same. The EOS or stop token that ends a row is in its tokens, not its text, as vLLM
    leaves it out. ``include_stop_str_in_output`` (vLLM's): the text ends after the stop string
    or token, not before.
    ``truncate_prompt_tokens`` (vLLM's): a prompt longer than this many tokens is read from
    its last that many (-1: as many as the loaded length holds with room for one new token),
    where it would be refused as too long; None: whole.
    ``proposer``: who proposes the draft tokens: ``"model"`` the draft model; ``"lookup"`` the
    continuation of the longest n-gram (``prompt_lookup_min`` .. ``prompt_lookup_max`` tokens)
    that ends the row and occurred earlier in its prompt or output (and of the generator's
    suffix cache, when it has one), ``num_draft_tokens`` at most; ``"hybrid"`` one of them per
    round, whichever is expected to give more tokens per second (`specrt.runtime.hybrid`).
    All are exactly lossless.
    """

    max_new_tokens: int = 64
    num_draft_tokens: int = 4
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    adaptive_draft: bool = False
    draft_schedule: str = "adaptive"
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    proposer: str = "hybrid"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    structured_output: StructuredOutput | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        def set(name: str, value: object) -> None:  # a frozen dataclass: normalise in place
            object.__setattr__(self, name, value)

        set("max_new_tokens", integer("max_new_tokens", self.max_new_tokens, 1))
        rule = f"use an integer in [0, {MAX_DRAFT_TOKENS}] (0 runs the target alone)"
        k = integer("num_draft_tokens", self.num_draft_tokens, 0, MAX_DRAFT_TOKENS, rule)
        set("num_draft_tokens", k)
        rule = "use a finite number >= 0 (0 = greedy)"
        set("temperature", number("temperature", self.temperature, rule, lambda t: t >= 0))
        rule = "use an integer >= 0 (0 = no top-k filter)"
        set("top_k", integer("top_k", self.top_k, 0, rule=rule))
        rule = "use a number in (0, 1] (1 = no nucleus filter)"
        set("top_p", number("top_p", self.top_p, rule, lambda p: 0 < p <= 1))
        rule = "use a number in [0, 1] (0 = no min-p filter)"
        set("min_p", number("min_p", self.min_p, rule, lambda p: 0 <= p <= 1))
        if self.seed is not None:
            rule = "use a non-negative integer, or none for a random seed"
            set("seed", integer("seed", self.seed, 0, rule=rule))
        set("ignore_eos", flag("ignore_eos", self.ignore_eos))
        set("skip_special_tokens", flag("skip_special_tokens", self.skip_special_tokens))
        included = flag("include_stop_str_in_output", self.include_stop_str_in_output)
        set("include_stop_str_in_output", included)
        set("adaptive_draft", flag("adaptive_draft", self.adaptive_draft))
        if self.draft_schedule not in DRAFT_SCHEDULES:
            raise out_of_range(
                "draft_schedule", self.draft_schedule, f"use one of {DRAFT_SCHEDULES}"
            )
        if self.adaptive_draft:
            warnings.warn(
                "GenerationConfig(adaptive_draft=True) is deprecated: it is "
                'draft_schedule="adaptive", which it sets: give that instead',
                DeprecationWarning,
                stacklevel=3,  # the caller of GenerationConfig(...)
            )
            if self.draft_schedule == "fixed":
                set("draft_schedule", "adaptive")
            set("adaptive_draft", False)  # said once: copies (`replace`) do not say it again
        set("stop", stop_strings(self.stop))
        set("stop_token_ids", stop_ids(self.stop_token_ids))
        if self.proposer not in PROPOSERS:
            raise out_of_range("proposer", self.proposer, f"use one of {PROPOSERS}")
        rule = f"use an integer in [1, {MAX_NGRAM}]"
        low = integer("prompt_lookup_min", self.prompt_lookup_min, 1, MAX_NGRAM, rule)
        rule = (
            f"use an integer in [prompt_lookup_min, {MAX_NGRAM}] (prompt_lookup_min is {low}: "
            "raise prompt_lookup_max with it)"
        )
        high = integer("prompt_lookup_max", self.prompt_lookup_max, low, MAX_NGRAM, rule)
        set("prompt_lookup_min", low)
        set("prompt_lookup_max", high)
        if self.logprobs is not None:
            rule = f"use an integer in [0, {MAX_LOGPROBS}] (0: the chosen token's alone)"
            set("logprobs", integer("logprobs", self.logprobs, 0, MAX_LOGPROBS, rule))
        if self.prompt_logprobs is not None:
            rule = f"use an integer in [0, {MAX_LOGPROBS}] (0: each prompt token's alone)"
            top = integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, rule)
            set("prompt_logprobs", top)
        set("logit_bias", logit_bias(self.logit_bias))
        rule = "use a number > 0 (1 = none; above 1 discourages repeating)"
        penalty = number("repetition_penalty", self.repetition_penalty, rule, lambda r: r > 0)
        set("repetition_penalty", penalty)
        rule = f"use an integer in [0, max_new_tokens] (max_new_tokens is {self.max_new_tokens})"
        set("min_tokens", integer("min_tokens", self.min_tokens, 0, self.max_new_tokens, rule))
        for name in ("presence_penalty", "frequency_penalty"):
            rule = "use a number in [-2, 2] (0 = none), as OpenAI's"
            set(name, number(name, getattr(self, name), rule, lambda v: -2 <= v <= 2))
        if self.structured_output is not None:
            set("structured_output", structured_output(self))
        if self.truncate_prompt_tokens is not None:
            rule = "use an integer >= 1, or -1 for as many as the context holds"
            kept = integer("truncate_prompt_tokens", self.truncate_prompt_tokens, -1, rule=rule)
            if kept == 0:
                raise out_of_range("truncate_prompt_tokens", kept, rule)
            set("truncate_prompt_tokens", kept)

    def kept_prompt(self, ids: list[int], max_positions: int) -> list[int]:
        """The prompt's tokens the row reads: its last ``truncate_prompt_tokens`` (-1: as many
        as ``max_positions`` holds, leaving one for a new token)."""
        keep = self.truncate_prompt_tokens
        if keep == -1:
            keep = max(1, max_positions - 1)
        return ids[-keep:] if keep is not None and len(ids) > keep else ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def reproducible(self) -> bool:
        """Sampling under a seed: the row draws by position (`sampling.KeyedDraws`), so its
        tokens depend on the seed and the target alone."""
        return self.seed is not None and not self.greedy

    @property
    def processors(self) -> LogitsProcessors | None:
        """The logits processors the config asks for (`specrt.runtime.processors`); None:
        none. ``min_tokens`` holds off the stop tokens here: `processors_for` EOS too."""
        return self.processors_for(())

    def processors_for(
        self, eos_token_ids, grammar: GrammarState | None = None
    ) -> LogitsProcessors | None:
        """`processors`, with ``min_tokens`` holding off a model's EOS too (unless ignored),
        and a row's own ``grammar`` (`grammar.row_grammar`) where it asks for structured
        output."""
        ends = tuple(sorted(self.ends(eos_token_ids)))
        found = LogitsProcessors(
            self.logit_bias, self.repetition_penalty, self.presence_penalty,
            self.frequency_penalty, self.min_tokens, ends, grammar,
        )  # fmt: skip
        return found if found.active else None

    def ends(self, eos_token_ids) -> frozenset[int]:
        """The tokens that end a row: the model's EOS (unless ignored) and the stop tokens."""
        ends = frozenset() if self.ignore_eos else frozenset(eos_token_ids)
        return ends.union(self.stop_token_ids) if self.stop_token_ids else ends  # (every round)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p)


def structured_output(config: GenerationConfig) -> StructuredOutput:
    """``config.structured_output`` (a `StructuredOutput`, or a dict of its fields), checked
    against the rest of the config and compiled once."""
    given = StructuredOutput.of(config.structured_output)
    if config.ignore_eos or config.min_tokens:  # the grammar ends the answer with EOS
        name = "ignore_eos" if config.ignore_eos else "min_tokens"
        raise InvalidInputError(
            f"{name} cannot be combined with structured output, whose answer ends with EOS "
            "where its grammar is complete: leave one out",
            name,
        )
    given.check()
    return given


# Every new token is matched against each stop string of its row in the shared loop, so a
# request's stops slow every row of its batches: 150,000 made others' requests 50x slower.
# OpenAI takes 4; these bounds are far above any real use.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096


def stop_strings(stop: object) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (one string is one stop string)."""
    given = stop
    if isinstance(stop, str):
        stop = (stop,)
    if isinstance(stop, (list, tuple)) and (
        len(stop) > MAX_STOP_STRINGS
        or sum(len(s) for s in stop if isinstance(s, str)) > MAX_STOP_CHARS
    ):
        raise InvalidInputError(
            f"stop=[{len(stop)} strings] is too much to match at every token: give at most "
            f"{MAX_STOP_STRINGS} stop strings of {MAX_STOP_CHARS} characters in all",
            "stop",
        )
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        shown = list(given) if isinstance(given, tuple) else given  # the CLI's --stop: a tuple
        raise InvalidInputError(
            f"stop={shown!r} is not a stop string: use a string or a list of non-empty strings",
            "stop",
        )
    return tuple(stop)


def stop_ids(ids: object) -> tuple[int, ...]:
    """``ids`` as a tuple of token ids (non-negative integers)."""
    if not isinstance(ids, (list, tuple)):
        message = f"stop_token_ids={ids!r}: use a list of token ids (integers >= 0)"
        raise InvalidInputError(message, "stop_token_ids")
    if len(ids) > MAX_STOP_STRINGS:  # matched at every token, as stop strings are
        message = f"stop_token_ids=[{len(ids)} ids]: give at most {MAX_STOP_STRINGS}"
        raise InvalidInputError(message, "stop_token_ids")
    return tuple(integer("stop_token_ids", i, 0, rule="use token ids (integers >= 0)") for i in ids)


MAX_BIAS = 100  # OpenAI's bound on a logit_bias value (-100 bans a token, 100 forces it)
MAX_BIASED = 1024  # tokens one config may bias: added at every position of every round


def logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """``bias`` ({token id: value}, ids as integers or as the decimal strings JSON keys are,
    or (id, value) pairs) as sorted (id, value) pairs."""
    rule = f"use {{token id: a number in [-{MAX_BIAS}, {MAX_BIAS}]}}"
    pairs = bias.items() if isinstance(bias, dict) else bias
    if not isinstance(pairs, (list, tuple, type({}.items()))):
        raise InvalidInputError(f"logit_bias={bias!r}: {rule}", "logit_bias")
    pairs = list(pairs)
    if len(pairs) > MAX_BIASED:
        message = f"logit_bias of {len(pairs)} tokens: give at most {MAX_BIASED}"
        raise InvalidInputError(message, "logit_bias")
    out = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise InvalidInputError(f"logit_bias={bias!r}: {rule}", "logit_bias")
        token, value = pair
        if isinstance(token, str) and token.isdigit() and token.isascii():
            token = int(token)
        token = integer("logit_bias", token, 0, rule=f"token ids are integers >= 0; {rule}")
        try:
            out[token] = number(f"logit_bias[{token}]", value, rule, lambda v: abs(v) <= MAX_BIAS)
        except InvalidInputError as exc:
            exc.field = "logit_bias"  # the request's field, as the server names it
            raise
    return tuple(sorted(out.items()))

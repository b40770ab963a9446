"""OpenAI API bodies (requests read, completions, chat completions and errors written), shared
by `specrt serve` and `specrt batch`'s OpenAI lines: one reading and one shape wherever a
client meets them. No HTTP here."""

from __future__ import annotations

import itertools
import json
import sys
import time
import uuid
from collections.abc import Callable

from specrt.chat import FIELDS as RENDERING_FIELDS
from specrt.errors import RequestError
from specrt.openai_structured import STRUCTURED, structured_output

COMPLETION, CHAT = "completion", "chat"
# OpenAI request fields -> GenerationConfig fields (top_k is an extension, as in vLLM).
FIELDS = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",  # chat's newer name
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "ignore_eos": "ignore_eos",  # vLLM's extension
    "min_p": "min_p",  # vLLM's extension
    "stop_token_ids": "stop_token_ids",  # vLLM's extension
    "logit_bias": "logit_bias",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",  # vLLM's extension
    "min_tokens": "min_tokens",  # vLLM's extension
    "skip_special_tokens": "skip_special_tokens",  # vLLM's extension
    "include_stop_str_in_output": "include_stop_str_in_output",  # vLLM's extension
    "truncate_prompt_tokens": "truncate_prompt_tokens",  # vLLM's extension
}
MAX_N = 128  # choices one request may ask for (OpenAI's limit)
MAX_PROMPTS = 128  # prompts one completion may give (as many as choices)
LOGPROBS_CONTEXT = 6  # tokens before one that its text is decoded after (`logprobs_body`)
# vLLM's: log-probabilities name their tokens "token_id:N" (text does not always give a token
# back: a piece of a character, two tokens of one text)
AS_IDS = "return_tokens_as_token_ids"
MAX_LOGPROBS = 20  # most likely tokens a position may list: OpenAI's limit, and the runtime's
# OpenAI's max_tokens for a completion that gives none. Chat has no such default: it runs until
# the model stops or the context ends (as OpenAI's and vLLM's), which only the caller knows.
DEFAULT_MAX_TOKENS = 16
# Fields accepted only at values that ask for nothing specrt does not do (clients such as
# LangChain send them so): no tools. (Log-probabilities: `_logprobs`;
# echo: `read_request`.)
OFF_VALUES = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    # vLLM's extensions, which clients written for it send at these values
    "spaces_between_special_tokens": (None, True),
    "modalities": (None, ["text"]),
}
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats", "include_obfuscation")
IGNORED = {
    "model",
    "prompt",
    "messages",
    "stream",
    "n",
    "user",
    "stream_options",
    "store",
    "metadata",
    "service_tier",
    "parallel_tool_calls",
    "logprobs",
    "top_logprobs",
    "echo",
    AS_IDS,  # `logprobs_body`
    "priority",  # vLLM's: the server's queue reads it (`specrt serve --scheduling-policy`)
    *OFF_VALUES,
}
IGNORED |= set(STRUCTURED)  # read by `structured_output`


def same(value: object, off: object) -> bool:
    """``value`` is the off value ``off``, a boolean only as a boolean (0 == False in Python)."""
    if isinstance(value, bool) or isinstance(off, bool):
        return value is off
    return value == off


def read_json(data: bytes | str) -> object:
    """A request body's JSON. Raises `RequestError` for text that is not JSON, and for JSON
    Python cannot read (nested past its recursion limit, an integer past its digit limit),
    which `json.loads` raises as RecursionError and ValueError."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON ({exc})") from None
    except RecursionError:
        raise RequestError(
            "the request body is nested too deeply to read: send a JSON object of the "
            "request's fields"
        ) from None
    except ValueError as exc:
        if "digits" not in str(exc):
            raise RequestError(f"the request body is not valid JSON ({exc})") from None
        limit = sys.get_int_max_str_digits()
        raise RequestError(
            f"the request body holds an integer of more than {limit} digits: no field takes "
            "one; send a smaller number"
        ) from None


def read_request(
    body: dict, kind: str, default_max_tokens: int | None = DEFAULT_MAX_TOKENS, max_n: int = 1
):
    """An OpenAI request body of ``kind`` as (its prompts for a completion: `completion_prompts`;
    the messages for a chat; `GenerationConfig` fields it sets). ``null`` takes
    the default; fields for features specrt does not have are refused unless at their off
    value; ``default_max_tokens``: a completion's length where the body gives none (None: no
    length). A chat's length is never filled in: it runs to the end of the context, which the
    caller knows. ``n`` (`choices`) may be up to ``max_n``. Raises `RequestError`."""
    body = {key: value for key, value in body.items() if value is not None}  # null: default
    if not isinstance(body.get("stream", False), bool):
        raise RequestError("stream must be true or false", "stream")
    stream_usage(body)  # stream_options checked
    n = body.get("n", 1)
    if max_n == 1 and n != 1:
        raise RequestError(
            f"n={json.dumps(n)}: only n = 1 is supported here; send one request per choice", "n"
        )
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= max_n:
        raise RequestError(f"n={json.dumps(n)}: use an integer from 1 to {max_n}", "n")
    if "stream_options" in body and not body.get("stream"):
        message = "stream_options is only allowed with stream: true (as OpenAI and vLLM answer)"
        raise RequestError(message, "stream_options")
    unknown = sorted(set(body) - set(FIELDS) - IGNORED)
    if kind == COMPLETION and set(unknown) & set(RENDERING_FIELDS):
        field = min(set(unknown) & set(RENDERING_FIELDS))
        message = f"{field} is a chat field: a completion's prompt is sent as it is, not rendered"
        raise RequestError(message, field)
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}", unknown[0])
    for field, off in OFF_VALUES.items():  # on, an answer without them would be wrong
        if not any(same(body.get(field), value) for value in off):
            shown = " or ".join(json.dumps(o) for o in off[1:])
            raise RequestError(
                f"{field} is not supported by specrt: leave it out (or {shown})", field
            )
    lengths = [body[f] for f in ("max_tokens", "max_completion_tokens") if f in body]
    if len(lengths) == 2 and lengths[0] != lengths[1]:
        raise RequestError(
            "max_tokens and max_completion_tokens differ: give one", "max_completion_tokens"
        )
    if kind == CHAT:
        if "prompt" in body:
            raise RequestError("a chat request gives messages, not a prompt", "prompt")
        prompt = body.get("messages")
    else:
        if "messages" in body:
            raise RequestError("a completion request gives a prompt, not messages", "messages")
        prompt = completion_prompts(body.get("prompt"))
    options = {ours: body[theirs] for theirs, ours in FIELDS.items() if theirs in body}
    structured = structured_output(body)
    if structured is not None:
        options["structured_output"] = structured
    logprobs = _logprobs(body, kind)
    if not isinstance(body.get(AS_IDS, False), bool):
        raise RequestError(f"{AS_IDS}={json.dumps(body[AS_IDS])}: use true or false", AS_IDS)
    if logprobs is not None:
        options["logprobs"] = logprobs
    if echoed(body, kind):
        if body.get("stream") and scored_only(body):
            message = "echo with max_tokens 0 is not streamed: leave stream out for it"
            raise RequestError(message, "max_tokens")
        if logprobs is not None:  # the prompt's tokens are listed too
            options["prompt_logprobs"] = logprobs
        if options.get("max_new_tokens") == 0:  # the prompt alone (`scored_only`)
            options["max_new_tokens"] = 1
    if default_max_tokens is not None and kind == COMPLETION:
        options.setdefault("max_new_tokens", default_max_tokens)
    if options.get("top_k") == -1 and not isinstance(options["top_k"], bool):
        options["top_k"] = 0  # vLLM's "no top-k filter", which its clients send
    if "max_new_tokens" in options:
        length = options["max_new_tokens"]
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            field = "max_tokens" if "max_tokens" in body else "max_completion_tokens"
            raise RequestError(f"{field}={json.dumps(length)}: use an integer >= 1", field)
    return prompt, options


def stream_usage(body: dict) -> str | None:
    """What a stream's chunks carry of the usage, as ``stream_options`` asks: None (none),
    ``"final"`` (a last chunk of it, OpenAI's ``include_usage``) or ``"continuous"`` (every
    chunk its choice's so far too, vLLM's ``continuous_usage_stats``). Raises `RequestError`."""
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        message = 'stream_options must be an object ({"include_usage": true})'
        raise RequestError(message, "stream_options")
    for key, value in options.items():
        if key not in STREAM_OPTIONS:
            message = f"stream_options.{key} is unknown: it takes {', '.join(STREAM_OPTIONS)}"
            raise RequestError(message, "stream_options")
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"stream_options.{key} must be true or false", "stream_options")
    if options.get("include_obfuscation"):  # OpenAI's padding of chunks: not written here
        message = "stream_options.include_obfuscation is not supported by specrt: send false"
        raise RequestError(message, "stream_options")
    if not options.get("include_usage"):  # vLLM's rule: continuous stats come with it only
        return None
    return "continuous" if options.get("continuous_usage_stats") else "final"


def completion_prompts(prompt: object) -> list[str | list[int]]:
    """A completion's ``prompt`` as the list of its prompts, each text or token ids: OpenAI
    takes a string, an array of strings, an array of token ids or an array of those. Raises
    `RequestError` for anything else."""
    several = isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt)
    prompts = prompt if several else [prompt]
    for one in prompts:
        if isinstance(one, list) and all(_is_token(t) for t in one):
            continue
        if not isinstance(one, str):
            raise RequestError(
                "prompt must be a string, a list of token ids, or a list of either (several "
                "prompts)",
                "prompt",
            )
    if several and len(prompts) > MAX_PROMPTS:
        message = f"prompt is a list of {len(prompts)} prompts: send at most {MAX_PROMPTS}"
        raise RequestError(message, "prompt")
    return prompts


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def echoed(body: dict, kind: str) -> bool:
    """Whether a completion body asks for its prompt before the answer (``echo``, with its
    tokens' log-probabilities where it asks for them). Raises `RequestError`."""
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise RequestError(f"echo={json.dumps(echo)}: use true or false", "echo")
    if echo and kind == CHAT:
        raise RequestError("echo is a completion field: a chat answer has no prompt text", "echo")
    return echo


def scored_only(body: dict) -> bool:
    """An echoed completion with ``max_tokens: 0``: the prompt and its log-probabilities alone
    (one token is generated, and left out)."""
    return bool(body.get("echo")) and body.get("max_tokens", body.get("max_completion_tokens")) == 0


def echo_text(body: dict, kind: str, given: object, ids: list[int], decode) -> str | None:
    """The prompt text an echoed completion gives before its answer (None: not echoed): the
    prompt ``given`` as the body gives it, where text, or its token ids' text."""
    if not echoed(body, kind):
        return None
    return given if isinstance(given, str) else decode(ids)


def _logprobs(body: dict, kind: str) -> int | None:
    """The most likely tokens a body asks to list at each new token (0: the chosen one's
    log-probability alone; None: none): a completion's ``logprobs`` (an integer), a chat's
    ``logprobs: true`` with ``top_logprobs``, as OpenAI reads them."""
    ask, top = body.get("logprobs"), body.get("top_logprobs")
    rule = f"use an integer from 0 to {MAX_LOGPROBS}"
    if kind == COMPLETION:
        if top is not None:
            message = "top_logprobs is a chat field: a completion gives logprobs (an integer)"
            raise RequestError(message, "top_logprobs")
        if ask is None:
            return None
        if not isinstance(ask, int) or isinstance(ask, bool) or not 0 <= ask <= MAX_LOGPROBS:
            raise RequestError(f"logprobs={json.dumps(ask)}: {rule}", "logprobs")
        chosen = ask
    else:
        if ask is not None and not isinstance(ask, bool):
            raise RequestError(f"logprobs={json.dumps(ask)}: use true or false", "logprobs")
        if top is not None and (not isinstance(top, int) or isinstance(top, bool)
                                or not 0 <= top <= MAX_LOGPROBS):  # fmt: skip
            raise RequestError(f"top_logprobs={json.dumps(top)}: {rule}", "top_logprobs")
        if not ask:
            if top:
                raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        chosen = top or 0
    return chosen


def logprobs_body(
    kind: str,
    entries: list,
    decode,
    before: list[int] = (),
    offset: int = 0,
    as_ids: bool = False,
) -> dict:
    """A choice's ``logprobs`` as OpenAI gives them, from `GenerationResult.logprobs`
    (``decode``: token ids to text): a completion's token strings, log-probabilities, most
    likely alternatives and text offsets; a chat's content entries with their bytes. A token's
    text is what it adds after the tokens before it (decoded alone, a word's leading space
    may be lost), an alternative's what it would have added there. ``before``: the tokens
    before ``entries`` (a stream's earlier chunks), ``offset``: their text's length.
    ``as_ids`` (vLLM's `AS_IDS`): tokens named ``"token_id:N"``; the offsets and bytes stay
    their text's."""
    return _logprobs_shape(kind, entries, _named(entries, decode, before, as_ids), offset)


def _named(entries: list, decode, before: list[int], as_ids: bool) -> list:
    """Each entry's token and its alternatives (None: none) as (name, text[, logprob])."""
    ids = [*before, *(entry.token for entry in entries)]
    named = []
    for i, entry in enumerate(entries, len(before)):
        context = ids[max(0, i - LOGPROBS_CONTEXT) : i]
        skip = len(decode(context))
        tokens = [entry.token, *(t for t, _ in entry.top or ())]
        texts = {t: decode([*context, t])[skip:] for t in tokens}
        name = {t: f"token_id:{t}" if as_ids else text for t, text in texts.items()}
        top = entry.top  # None: an echoed prompt's first token, which nothing predicts
        alternatives = None if top is None else [(name[t], texts[t], lp) for t, lp in top]
        named.append(((name[entry.token], texts[entry.token]), alternatives))
    return named


def _logprobs_shape(kind: str, entries: list, named: list, offset: int) -> dict:
    if kind == COMPLETION:
        lengths = (len(text) for (_, text), _ in named)
        offsets = list(itertools.accumulate(lengths, initial=offset))[: len(named)]
        return {
            "tokens": [name for (name, _), _ in named],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [
                None if top is None else {name: lp for name, _, lp in top} for _, top in named
            ],
            "text_offset": offsets,
        }

    def item(name: str, text: str, logprob: float) -> dict:
        return {"token": name, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        {**item(*token, e.logprob), "top_logprobs": [item(*t) for t in top]}
        for (token, top), e in zip(named, entries)
    ]
    return {"content": content, "refusal": None}


def token_text(tokenizer) -> Callable[[list[int]], str]:
    """Token ids as text for log-probabilities: the bundle's tokenizer's decode, or (a bundle
    without one) the ids themselves."""
    if tokenizer is not None:
        return tokenizer.decode
    return lambda ids: " ".join(map(str, ids))


class StreamedLogprobs:
    """One streamed choice's ``logprobs`` chunk by chunk: each chunk's tokens read after the
    ones before, as `logprobs_body` reads a whole answer's, the offsets counted on."""

    def __init__(self, kind: str, decode, as_ids: bool = False) -> None:
        self.kind, self.decode, self.as_ids = kind, decode, as_ids
        self.ids: list[int] = []
        self.offset = 0

    def body(self, entries: list) -> dict:
        named = _named(entries, self.decode, self.ids, self.as_ids)
        body = _logprobs_shape(self.kind, entries, named, self.offset)
        self.ids = [*self.ids, *(entry.token for entry in entries)][-LOGPROBS_CONTEXT:]
        self.offset += sum(len(text) for (_, text), _ in named)
        return body


def choices(body: dict) -> int:
    """How many choices a body `read_request` took asks for (its ``n``)."""
    return body.get("n") or 1


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4().hex}"


def completion(
    ident: str,
    kind: str,
    model: str,
    text: str | None,
    finish_reason: str | None,
    final: bool = False,
    index: int = 0,
) -> dict:
    """A completion (``final``: the whole answer) or one streamed chunk of ``kind``, of choice
    ``index``; ``text`` None: the chat stream's opening chunk (the role alone)."""
    if kind == COMPLETION:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        name = "text_completion"
    elif final:
        message = {"role": "assistant", "content": text}
        choice = {"index": index, "message": message, "finish_reason": finish_reason}
        name = "chat.completion"
    else:
        delta = {"role": "assistant"} if text is None else {"content": text}
        if finish_reason is not None and not text:
            delta = {}  # the finish chunk's delta is empty, as OpenAI sends it
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
        name = "chat.completion.chunk"
    return {
        "id": ident,
        "object": name,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; ``cached_tokens``: of the prompt's, those not read (prompt caching)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def spec_stats(stats: dict) -> dict:
    """The speculative report beside a completion (an extension), from
    `GenerationStats.to_dict()`."""
    return {
        "rounds": stats["rounds"],
        "draft_tokens": stats["drafted_tokens"],
        "accepted_tokens": stats["accepted_tokens"],
        "acceptance_rate": stats["acceptance_rate"],
        "accepted_per_position": stats["accepted_per_position"],
        "proposers": stats["proposers"],
    }


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

"""`specrt batch`'s OpenAI output: one line per row as OpenAI's batch output file has it
(``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``, the body
a completion or chat completion as `specrt serve` answers), for tools that read those files."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import NamedTuple

from specrt.openai_shapes import (
    CHAT,
    COMPLETION,
    completion,
    error_body,
    logprobs_body,
    new_id,
    spec_stats,
    usage,
)
from specrt.openai_token_ids import with_token_ids
from specrt.openai_tools import ToolCalling, answered, as_calls
from specrt.runtime.logprobs import TokenLogprob, echoed_entries

OUTPUT_FORMATS = ("auto", "specrt", "openai")  # auto: openai for an input of OpenAI lines only
KEYS = {"id", "custom_id", "response", "error"}


class Echo(NamedTuple):
    """An echoed completion's prompt: its text (as the line gave it), its token ids, and
    whether the line asked for it alone (``max_tokens: 0``)."""

    text: str
    ids: list[int]
    scored_only: bool


def record(
    row_id: str | int,
    result: dict,
    chat: bool,
    model: str,
    status: int = 200,
    decode: Callable[[list[int]], str] | None = None,
    echo: Echo | None = None,
    tools: ToolCalling | None = None,
    as_ids: bool = False,
    prompt_ids: list[int] | None = None,
) -> dict:
    """A row's line from its `specrt batch` record (``result``: a result or ``{"error"}``);
    ``status``: 400 for a row that could not run, 500 for a row the model failed. ``decode``
    (token ids to text) writes the log-probabilities a row asked for; ``echo``: the prompt
    an echoed completion gives before its answer, as `specrt serve` answers it; ``tools``:
    what a chat body asked of its tools (a required call comes back as ``tool_calls``);
    ``as_ids``: log-probabilities name their tokens by id; ``prompt_ids``: the prompt's token ids,
    given where the line asked for the token ids (vLLM's ``return_token_ids``)."""
    line: dict = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": row_id}
    response = {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}"}
    if "error" in result:
        message = result["error"]["message"]
        kind = "invalid_request_error" if status < 500 else "server_error"
        # The error in both places: tools check either the status or "error"
        response["body"] = error_body(message, kind)
        return {**line, "response": response, "error": {"code": kind, "message": message}}
    kind = CHAT if chat else COMPLETION
    ident, each = new_id(kind), result.get("choices", [result])  # a row of ``n`` choices
    body = completion(ident, kind, model, result["text"], result["finish_reason"], True)
    body["choices"] = [
        completion(ident, kind, model, c["text"], c["finish_reason"], True, i)["choices"][0]
        for i, c in enumerate(each)
    ]
    for choice, c in zip(body["choices"], each):
        entries = _entries(c.get("logprobs"))
        if echo is not None:
            if echo.scored_only:  # the prompt alone: the one token generated is left out
                choice["text"], entries = "", entries and []
            choice["text"] = echo.text + choice["text"]
            if entries is not None:
                entries = [*echoed_entries(echo.ids, _entries(c["prompt_logprobs"])), *entries]
        if entries is not None and decode is not None:
            choice["logprobs"] = logprobs_body(kind, entries, decode, as_ids=as_ids)
        reply = answered(tools, c["text"])
        if reply is not None:
            as_calls(choice, reply)
    if prompt_ids is not None:
        outputs = [[] if echo and echo.scored_only else c["token_ids"] for c in each]
        with_token_ids(body, kind, [prompt_ids] * len(each), outputs)
    stats = result["stats"]
    cached = stats.get("cached_tokens", 0)  # (records written before it was counted)
    generated = 0 if echo and echo.scored_only else sum(len(c["token_ids"]) for c in each)
    body["usage"] = usage(stats["prompt_tokens"], generated, cached)
    body["speculative_decoding"] = spec_stats(result["stats"])
    response["body"] = body
    return {**line, "response": response, "error": None}


def _entries(records: list[dict] | None) -> list[TokenLogprob] | None:
    """Log-probability entries as our records hold them (None: a prompt's first), as
    `TokenLogprob` s."""
    if records is None:
        return None
    return [e and TokenLogprob(e["token_id"], e["logprob"], e["top"]) for e in records]


def is_record(line: object) -> bool:
    """Whether ``line`` is one `record` writes."""
    return (
        isinstance(line, dict)
        and set(line) == KEYS
        and isinstance(line["response"], dict)
        and isinstance(line["response"].get("status_code"), int)
    )


def failed(line: dict) -> bool:
    return line["error"] is not None or line["response"]["status_code"] != 200

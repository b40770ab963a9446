"""OpenAI's Responses API (``POST /v1/responses``), answered as the chat route answers: its
``input`` and ``instructions`` become a chat's messages, rendered with the same template, and
the answer is the target's own to that chat. Clients written for it (OpenAI's newer SDK
examples, agent frameworks) got a 404.

Text in, text out: what needs state (``previous_response_id``, ``store`` kept for a later
GET), tools, reasoning items or images is refused in one 400 naming the field, as a field the
chat route does not take is. Nothing is stored: ``store`` is taken and the response is not
kept. The sampling fields the chat route takes beside OpenAI's (``seed``, ``top_k``, ``stop``,
vLLM's extensions) pass through.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from specrt.errors import SpecrtError
from specrt.openai_shapes import FIELDS, RequestError, same, spec_stats
from specrt.runtime.handles import RequestHandle, merged
from specrt.runtime.results import GenerationResult

# Responses fields taken at any value (echoed or ignored: nothing is stored or billed here)
TAKEN = ("model", "stream", "metadata", "user", "store", "service_tier", "parallel_tool_calls",
         "prompt_cache_key", "safety_identifier", "priority")  # fmt: skip
# Fields taken only at the value that asks for nothing specrt does not do
# (null, as in every body, is the default)
OFF = {
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "truncation": ("disabled",),
    "previous_response_id": (),
    "conversation": (),
    "include": ([],),
    "reasoning": ({},),
    "background": (False,),
    "top_logprobs": (0,),
    "max_tool_calls": (),
    "prompt": (),
}
WHY = {
    "previous_response_id": "no response is stored here: send the whole conversation as input",
    "conversation": "no conversation is stored here: send the whole conversation as input",
    "tools": "tools are answered on /v1/chat/completions",
    "tool_choice": "tools are answered on /v1/chat/completions",
    "top_logprobs": "log-probabilities are answered on /v1/chat/completions",
    "include": "log-probabilities are answered on /v1/chat/completions",
}
# A chat's own sampling fields that pass through (its length is max_output_tokens here)
PASSED = set(FIELDS) - {"max_tokens", "max_completion_tokens"}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str = "resp") -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_body(body: dict) -> dict:
    """The chat request a Responses body asks for. Raises `RequestError` naming the field."""
    body = {field: value for field, value in body.items() if value is not None}
    chat: dict = {}
    for field, value in body.items():
        if field in ("input", "instructions", "max_output_tokens", "text") or field in TAKEN:
            continue
        if field in OFF:
            if not any(same(value, off) for off in OFF[field]):
                why = WHY.get(field, "send it at its default, or leave it out")
                raise RequestError(f"{field}={json.dumps(value)}: {why}", field)
        elif field in PASSED:
            chat[field] = value
        else:
            raise RequestError(f"unknown field {field!r} for /v1/responses", field)
    chat["messages"] = _messages(body.get("input"), body.get("instructions"))
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    chat["response_format"] = _format(body.get("text"))
    for field in ("stream", "priority", "model"):
        if body.get(field) is not None:
            chat[field] = body[field]
    return chat


def _messages(given: object, instructions: object) -> list[dict]:
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions must be a string (a system message)", "instructions")
    messages = [] if instructions is None else [{"role": "system", "content": instructions}]
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise RequestError("input must be a string or a list of messages", "input")
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise RequestError(
                f"{where} is a {kind!r} item: /v1/responses here takes messages of text "
                '({"role": "user", "content": "..."})',
                "input",
            )
        role = item.get("role")
        if role not in ROLES:
            raise RequestError(
                f"{where}.role={json.dumps(role)}: use one of {list(ROLES)}", "input"
            )
        messages.append({"role": ROLES[role], "content": _text(item.get("content"), where)})
    return messages


def _text(content: object, where: str) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise RequestError(
                f"{where}.content[{j}] is {json.dumps(kind)}: only text parts "
                f"({', '.join(TEXT_PARTS)}) are read here",
                "input",
            )
        texts.append(part["text"])
    return "".join(texts)


def _format(text: object) -> dict | None:
    """``text.format`` as the chat route's ``response_format``."""
    if text is None:
        return None
    shape = text.get("format") if isinstance(text, dict) else None
    kind = shape.get("type") if isinstance(shape, dict) else None
    if kind in (None, "text") and isinstance(text, dict) and set(text) <= {"format", "verbosity"}:
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {key: shape[key] for key in ("name", "schema", "strict") if key in shape}
        return {"type": "json_schema", "json_schema": schema}
    raise RequestError(
        'text must be {"format": {"type": "text"}}, {"type": "json_object"} or '
        '{"type": "json_schema", "name": ..., "schema": {...}}',
        "text",
    )


class ResponseShape:
    """The response object of one request, whole or as the stream's events build it."""

    def __init__(self, ident: str, model: str, body: dict, handle: RequestHandle) -> None:
        self.ident, self.model, self.body = ident, model, body
        self.config = handle.request.config
        self.created = int(time.time())
        self.item_id = new_id("msg")
        self._sequence = 0

    def message(self, text: str, status: str) -> dict:
        content = [] if status == "in_progress" else [_part(text)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": content}  # fmt: skip

    def response(self, result: GenerationResult | None) -> dict:
        """The response object: in progress (None) or ended with ``result``."""
        body, config = self.body, self.config
        status, output, usage, details = "in_progress", [], None, None
        if result is not None:
            cut = result.finish_reason == "length"
            status = "incomplete" if cut else "completed"
            details = {"reason": "max_output_tokens"} if cut else None
            output = [self.message(result.text, "incomplete" if cut else "completed")]
            usage = _usage(result)
        reply = {
            "id": self.ident, "object": "response", "created_at": self.created,
            "status": status, "error": None, "incomplete_details": details,
            "model": self.model, "output": output,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": config.temperature, "top_p": config.top_p,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice") or "auto", "tools": [],
            "text": body.get("text") or {"format": {"type": "text"}},
            "truncation": "disabled", "metadata": body.get("metadata") or {},
            "user": body.get("user"), "store": False, "background": False, "usage": usage,
        }  # fmt: skip
        if result is not None:
            reply["speculative_decoding"] = spec_stats(result.stats.to_dict())
        return reply

    def event(self, kind: str, **fields) -> str:
        """One server-sent event, numbered as the Responses API numbers them."""
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(result: GenerationResult) -> dict:
    stats, output = result.stats, len(result.token_ids)
    return {
        "input_tokens": stats.prompt_tokens,
        "input_tokens_details": {"cached_tokens": stats.cached_tokens},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": stats.prompt_tokens + output,
    }


async def events(shape: ResponseShape, handle: RequestHandle) -> AsyncIterator[str]:
    """The stream: the response created, its message and text part opened, a delta per piece
    of text, then each closed and the response completed (or incomplete, cut at
    ``max_output_tokens``). A client that goes away cancels the request (its iterator
    closes)."""
    where = {"item_id": shape.item_id, "output_index": 0, "content_index": 0}
    yield shape.event("response.created", response=shape.response(None))
    yield shape.event("response.in_progress", response=shape.response(None))
    item = shape.message("", "in_progress")
    yield shape.event("response.output_item.added", output_index=0, item=item)
    yield shape.event("response.content_part.added", part=_part(""), **where)
    try:
        async for _, delta in merged([handle]):
            if delta is not None and delta.text:
                yield shape.event("response.output_text.delta", delta=delta.text, logprobs=[],
                                  **where)  # fmt: skip
        result = handle.result()
    except SpecrtError as exc:  # the service failed the request: the stream says so and ends
        yield shape.event("error", code="server_error", message=str(exc), param=None)
        return
    text = result.text
    yield shape.event("response.output_text.done", text=text, logprobs=[], **where)
    yield shape.event("response.content_part.done", part=_part(text), **where)
    whole = shape.response(result)
    yield shape.event("response.output_item.done", output_index=0, item=whole["output"][0])
    ended = "response.incomplete" if whole["status"] == "incomplete" else "response.completed"
    yield shape.event(ended, response=whole)

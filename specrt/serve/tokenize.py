"""vLLM's tokenizer routes, so that a client counts and checks tokens with the server's own
tokenizer and chat template rather than a copy of its own: ``POST /tokenize`` (a prompt, or
chat messages rendered exactly as the chat route renders them) and ``POST /detokenize``;
``GET /version``. At the root, not under /v1, as vLLM serves them (open without the API key)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specrt import __version__
from specrt import openai_tools as tools
from specrt.chat import FIELDS as RENDERING_FIELDS
from specrt.chat import ChatTemplate, ChatTemplateError, read_rendering
from specrt.errors import InvalidInputError, RequestError
from specrt.serve.replies import HttpError, check_model, refused

BOOLEANS = ("add_special_tokens", "return_token_strs")
TOKENIZE_FIELDS = {"model", "prompt", "messages", "tools", *BOOLEANS, *RENDERING_FIELDS}
NO_TEMPLATE = (
    "this bundle's tokenizer has no chat template: tokenize a prompt, or start the server "
    "with --chat-template"
)


def tokenizer_routes(
    model_name: str,
    tokenizer,
    template: ChatTemplate | None,
    max_model_len: int,
    json_body: Callable[[Request], Awaitable[dict]],
) -> list[Route]:
    """The routes for ``tokenizer`` (None: a bundle without one, whose routes say so) and the
    chat ``template`` the chat route renders with; ``json_body``: the server's reading of a
    request body (its size and time limits), raising `HttpError`."""

    def tokenized(body: dict) -> dict:
        body = _given(body, TOKENIZE_FIELDS, model_name)
        for field in BOOLEANS:
            if not isinstance(body.get(field, False), bool):
                raise _bad(f"{field}={json.dumps(body[field])}: use true or false", field)
        if ("prompt" in body) == ("messages" in body):
            raise _bad("give a prompt (text) or messages (a chat), one of them", "prompt")
        _needs(tokenizer)
        if "messages" in body:
            if template is None:
                raise _bad(NO_TEMPLATE, "messages")
            try:
                rendering, _ = read_rendering(body)
                offered, _ = tools.read_tools({"tools": body.get("tools"), "tool_choice": "none"})
                text = template.prompt(body["messages"], offered and offered.tools, rendering)
            except RequestError as exc:
                raise _bad(str(exc), exc.param) from exc
            except ChatTemplateError as exc:
                raise _bad(str(exc), "messages") from exc
            special = body.get("add_special_tokens", False)  # the template writes its own
        else:
            chat_only = sorted(set(body) & {"tools", *RENDERING_FIELDS})
            if chat_only:
                message = f"{chat_only[0]} is a chat field: a prompt is tokenized as it is"
                raise _bad(message, chat_only[0])
            text, special = body["prompt"], body.get("add_special_tokens", True)
        try:
            ids = tokenizer.encode(text, add_special_tokens=special, counted=True)
        except InvalidInputError as exc:
            raise _bad(str(exc), "prompt" if "prompt" in body else "messages") from exc
        strings = tokenizer.token_strings(ids) if body.get("return_token_strs") else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                "token_strs": strings}  # fmt: skip

    def detokenized(body: dict) -> dict:
        body = _given(body, {"model", "tokens"}, model_name)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(_is_id(i) for i in ids):
            raise _bad("tokens must be a list of token ids (integers)", "tokens")
        _needs(tokenizer)
        unknown = [i for i, s in zip(ids, tokenizer.token_strings(ids)) if s is None]
        if unknown:
            raise _bad(f"token id {unknown[0]} is not in the tokenizer's vocabulary", "tokens")
        return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}

    def route(answer: Callable[[dict], dict]):
        async def endpoint(request: Request) -> Response:
            try:  # off the event loop: a long prompt's tokenizing must not stall the rest
                return JSONResponse(await run_in_threadpool(answer, await json_body(request)))
            except HttpError as exc:
                return refused(exc)

        return endpoint

    async def version(request: Request) -> Response:
        return JSONResponse({"version": __version__})

    return [
        Route("/tokenize", route(tokenized), methods=["POST"]),
        Route("/detokenize", route(detokenized), methods=["POST"]),
        Route("/version", version),
    ]


def _given(body: dict, fields: set[str], model_name: str) -> dict:
    """The body's fields but those sent as null (the default), checked: the model, no field
    the route does not take (``chat_template``: the server's own)."""
    body = {key: value for key, value in body.items() if value is not None}
    check_model(body, model_name)
    unknown = sorted(set(body) - fields)
    if "chat_template" in unknown:
        message = (
            "chat_template: this server renders chats with one template, its bundle's or the "
            "one it was started with (--chat-template); leave it out"
        )
        raise _bad(message, "chat_template")
    if unknown:
        raise _bad(f"unknown field(s) {unknown}", unknown[0])
    return body


def _needs(tokenizer) -> None:
    if tokenizer is None:
        raise _bad("this bundle has no tokenizer: its prompts are token ids already", None)


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bad(message: str, param: str | None) -> HttpError:
    return HttpError(400, message, "invalid_request_error", param)

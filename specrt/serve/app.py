"""The OpenAI-compatible HTTP API over a `specrt.runtime.service.Service` (Starlette).

``POST /v1/completions`` (``stream`` as server-sent events), ``POST /v1/chat/completions``
(rendered with the bundle's chat template; 400 without one) and ``POST /v1/responses`` (as a
chat: `specrt.serve.responses`), ``GET /v1/models`` (and
``/v1/models/{id}``), vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``
(`specrt.serve.tokenize`), ``GET /health``, ``GET /metrics`` (Prometheus). Errors are
OpenAI-style bodies: 400 bad request, 404 unknown model, 400 prompt too long (code
"context_length_exceeded"), 413 body too large, 429 overloaded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from specrt import openai_shapes as shapes
from specrt import openai_tools as tools
from specrt.chat import ChatTemplate, ChatTemplateError, Rendering, read_rendering
from specrt.errors import (
    InvalidInputError,
    OverloadedError,
    PromptTooLongError,
    ServiceClosedError,
    SpecrtError,
)
from specrt.openai_shapes import (
    CHAT,
    COMPLETION,
    FIELDS,
    MAX_N,
    RequestError,
    choices,
    completion,
    new_id,
    read_json,
    read_request,
)
from specrt.openai_token_ids import token_ids_asked, with_token_ids
from specrt.runtime.config import GenerationConfig
from specrt.runtime.handles import RequestHandle, merged
from specrt.runtime.logprobs import echoed_entries
from specrt.runtime.results import GenerationResult
from specrt.runtime.service import Service
from specrt.serve import responses as responses_api
from specrt.serve.chunks import StreamExtras, answer_usage, spec_stats, sse
from specrt.serve.metrics import Metrics
from specrt.serve.middleware import BearerKey, CountAnswers
from specrt.serve.replies import HttpError, check_model, error, refused, unknown_route
from specrt.serve.request_log import log_finished, log_received
from specrt.serve.tokenize import tokenizer_routes

BODY_SLACK = 1 << 20  # bytes of a request body beside its prompt text (fields, messages' JSON)
BODY_TIMEOUT_S = 10.0  # for a request's body to arrive whole


def create_app(
    service: Service, model_name: str, defaults: GenerationConfig,
    api_key: str | None = None, tool_parser: str | None = None, chat_template: str | None = None,
) -> Starlette:  # fmt: skip
    """The app serving ``service`` as model ``model_name``; ``defaults``: the config a request
    starts from (its num_draft_tokens and draft schedule, above all). ``api_key``: the /v1
    routes answer only requests bearing it (`BearerKey`); ``tool_parser``: the format of the
    model's own tool calls, which ``tool_choice: "auto"`` reads (`specrt.openai_tools`);
    ``chat_template``: chats render with it in place of the bundle's (`ChatTemplate`)."""
    metrics = Metrics(service, model_name)
    created = int(time.time())
    # A character escaped in JSON takes at most 6 bytes (\\uXXXX); the rest of a body is small.
    max_body = 6 * service.generator.max_prompt_chars + BODY_SLACK
    tokenizer = service.generator.tokenizer
    # token ids as text (a bundle without a tokenizer: the ids themselves), for logprobs
    decode = shapes.token_text(tokenizer)
    template = (
        ChatTemplate.from_directory(tokenizer.directory, chat_template) if tokenizer else None
    )

    async def health(request: Request) -> Response:
        return JSONResponse(
            {"status": "ok", "running": service.running, "waiting": service.waiting}
        )

    max_model_len = service.generator.target.max_positions
    model = {"id": model_name, "object": "model", "created": created, "owned_by": "specrt",
             "max_model_len": max_model_len}  # fmt: skip

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model]})

    async def one_model(request: Request) -> Response:
        asked = request.path_params["name"]
        if asked != model_name:
            message = f"model {asked!r} is not served here (this is {model_name!r})"
            return error(404, message, "not_found_error", "model")
        return JSONResponse(model)

    async def metrics_page(request: Request) -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    def no_template() -> Response:
        return error(
            400,
            "this bundle's tokenizer has no chat template: use /v1/completions with a "
            "prompt, or start the server with --chat-template",
            "invalid_request_error",
        )

    async def chat(request: Request) -> Response:
        return no_template() if template is None else await answer(request, CHAT)

    async def completions(request: Request) -> Response:
        return await answer(request, COMPLETION)

    async def json_body(request: Request) -> dict:
        """The request's body, a JSON object; raises `HttpError`."""
        try:
            body = read_json(await asyncio.wait_for(read_body(request), BODY_TIMEOUT_S))
        except asyncio.TimeoutError:  # a client that stalls must not hold a shutdown
            message = f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s"
            raise HttpError(408, message, "invalid_request_error") from None
        except RequestError as exc:  # not JSON, or JSON Python cannot read (too deep, too long)
            raise HttpError(400, str(exc), "invalid_request_error", exc.param) from None
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object", "invalid_request_error")
        return body

    async def answer(request: Request, kind: str) -> Response:
        try:
            body = await json_body(request)
        except HttpError as exc:
            return refused(exc)
        ident = new_id(kind)
        submitted = await queued(body, kind, ident)
        if isinstance(submitted, Response):  # refused
            return submitted
        handles, stream, usage_mode, token_ids, tooling, echoes = submitted
        n, as_ids = choices(body), bool(body.get(shapes.AS_IDS))
        if stream:
            return StreamingResponse(
                events(handles, ident, kind, usage_mode, token_ids, as_ids, echoes, tooling, n),
                media_type="text/event-stream",
            )
        return await replied(
            request,
            handles,
            lambda results: whole(ident, kind, body, handles, results, token_ids, tooling, echoes),
        )

    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, answered as a chat (`specrt.serve.responses`)."""
        if template is None:
            return no_template()
        try:
            body = await json_body(request)
            asked = responses_api.chat_body(body)
        except HttpError as exc:
            return refused(exc)
        except RequestError as exc:
            return error(400, str(exc), "invalid_request_error", exc.param)
        ident = responses_api.new_id()
        submitted = await queued(asked, CHAT, ident)
        if isinstance(submitted, Response):
            return submitted
        [handle], stream = submitted[0], submitted[1]
        shape = responses_api.ResponseShape(ident, model_name, body, handle)
        if stream:
            return StreamingResponse(
                responses_api.events(shape, handle), media_type="text/event-stream"
            )
        return await replied(
            request, [handle], lambda results: JSONResponse(shape.response(results[0]))
        )

    async def queued(body: dict, kind: str, ident: str) -> tuple | Response:
        """The request's handles and how to answer them (`submit`), or its refusal."""
        try:  # off the event loop: a long prompt's tokenizing must not stall other requests
            return await run_in_threadpool(submit, body, kind, ident)
        except HttpError as exc:
            return refused(exc)
        except PromptTooLongError as exc:  # as OpenAI and vLLM answer it (400, not 413)
            param = "messages" if kind == CHAT else "prompt"
            return error(400, str(exc), "invalid_request_error", param, "context_length_exceeded")
        except ServiceClosedError:  # a retry here never succeeds: another replica may
            message = "the server is shutting down: it takes no more requests"
            return error(503, message, "service_unavailable_error")
        except OverloadedError as exc:
            return error(429, str(exc), "overloaded_error")
        except InvalidInputError as exc:  # a field out of range: named as the body named it
            param = next((f for f, ours in FIELDS.items() if ours == exc.field and f in body), None)
            param = param or (exc.field if exc.field in body else None)  # (priority)
            return error(400, str(exc), "invalid_request_error", param)

    def whole(
        ident: str, kind: str, body: dict, handles: list[RequestHandle],
        results: list[GenerationResult], token_ids: bool,
        tooling: tools.ToolCalling | None, echoes: list[str | None],
    ) -> Response:  # fmt: skip
        """A completion's or chat's whole answer."""
        n, as_ids = choices(body), bool(body.get(shapes.AS_IDS))
        if echoes[0] is not None and shapes.scored_only(body):  # the prompts alone
            results = [
                replace(r, text="", token_ids=[], logprobs=r.logprobs and []) for r in results
            ]
        body = chunk(ident, kind, "", None, final=True)
        body["choices"] = []
        for i, (result, echo) in enumerate(zip(results, echoes)):
            text, entries = result.text, result.logprobs
            if echo is not None:  # the prompt before the answer, as OpenAI's echo gives it
                text = echo + text
                if entries is not None:
                    prompt = handles[i].request.prompt
                    entries = [*echoed_entries(prompt, result.prompt_logprobs), *entries]
            choice = chunk(ident, kind, text, result.finish_reason, final=True, index=i)
            if entries is not None:
                written = shapes.logprobs_body(kind, entries, decode, as_ids=as_ids)
                choice["choices"][0]["logprobs"] = written
            reply = tools.answered(tooling, text)
            if reply is not None:
                tools.as_calls(choice["choices"][0], reply)
            body["choices"].append(choice["choices"][0])
        if token_ids:
            prompts = [handle.request.prompt for handle in handles]
            with_token_ids(body, kind, prompts, [result.token_ids for result in results])
        body["usage"] = answer_usage(results, n)
        body["speculative_decoding"] = spec_stats(results)
        return JSONResponse(body)

    async def replied(request: Request, handles: list[RequestHandle], reply) -> Response:
        """``reply(results)`` once the requests end; a 500 where one failed; a 499 (nobody reads
        it) where the client goes away first, which cancels them (their slots freed at the next
        round), as a streaming client's going does."""
        results = asyncio.gather(*(handle.wait() for handle in handles))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # the client gone, or this handler cancelled (a shutdown's deadline)
            gone.cancel()
            if not results.done():
                results.cancel()
                for handle in handles:
                    handle.cancel()
        if not results.done() or results.cancelled():
            return Response(status_code=499)
        try:
            return reply(results.result())
        except SpecrtError as exc:
            return error(500, str(exc), "server_error")

    async def disconnected(request: Request) -> None:
        """Returns once the client has gone (its body was read: what comes next is that)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def read_body(request: Request) -> bytes:
        """The body, refused with 413 once it passes what the longest prompt could take (as
        JSON text, every character escaped), declared or as it arrives."""
        too_big = HttpError(
            413,
            f"the request body is over {max_body} bytes, more than any prompt of this model "
            "needs; shorten the prompt",
            "invalid_request_error",
            "prompt",
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body:
            raise too_big
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > max_body:
                raise too_big
        return bytes(data)

    def submit(body: dict, kind: str, ident: str) -> tuple:
        """The ``n`` choices of each of the request's prompts queued (choice ``i`` of prompt
        ``p`` at ``p * n + i``, as OpenAI orders them; rows of one prompt read it once); all or
        none: a choice refused withdraws those queued before it. Returns the handles, whether
        to stream, how a stream carries the usage (`shapes.stream_usage`), whether the token
        ids are asked, what the body asked of tools, and the text each choice echoes (None:
        none)."""
        check_model(body, model_name)
        try:
            tooling, rendering = None, None
            token_ids, body = token_ids_asked(body)
            if kind == CHAT:
                tooling, body = tools.read_tools(body, tool_parser)
                rendering, body = read_rendering(body)
            prompt, options = read_request(body, kind, max_n=MAX_N)
            options = tools.with_tools(tooling, options)
        except RequestError as exc:
            raise HttpError(400, str(exc), "invalid_request_error", exc.param) from exc
        prompts = prompt
        if kind == CHAT:
            prompts = [chat_prompt(prompt, tooling and tooling.tools, rendering)]
            # No max_tokens: until the model stops or the context ends, as OpenAI's chat (at
            # least 1, so that a prompt too long is refused as such by submit)
            limit = service.generator.target.max_positions
            cut = GenerationConfig(truncate_prompt_tokens=options.get("truncate_prompt_tokens"))
            room = limit - len(cut.kept_prompt(prompts[0], limit))
            options.setdefault("max_new_tokens", max(1, room))
        config = GenerationConfig(**{**{f: getattr(defaults, f) for f in _DEFAULTED}, **options})
        n, priority = choices(body), body.get("priority")  # (checked by the service)
        priority = 0 if priority is None else priority  # null: the default, as elsewhere
        if n * len(prompts) > service.capacity:  # refused whatever the load: not a 429 to retry
            asked = f"n={n}" if len(prompts) == 1 else f"{len(prompts)} prompts of n={n} each"
            raise HttpError(
                400,
                f"{asked}: this server holds at most {service.capacity} requests at once (a "
                "slot each, or a place in the queue): ask for fewer choices or prompts",
                "invalid_request_error",
                "n" if len(prompts) == 1 else "prompt",
            )
        handles: list[RequestHandle] = []
        try:
            for given in prompts:  # one at a time: those queued are withdrawn on a refusal
                for index in range(n):
                    handles.append(service.submit(given, config, index=index, priority=priority))
        except BaseException:
            for handle in handles:
                handle.cancel()
            raise
        stream = bool(body.get("stream"))
        cut_short = config.truncate_prompt_tokens is not None
        for handle in handles:
            handle.add_done_callback(metrics.record)
            handle.add_gap_callback(metrics.inter_token_gap)
            log_received(ident, kind, handle, stream)
            handle.add_done_callback(lambda done: log_finished(ident, done))
        echoes = [
            # a prompt cut short (truncate_prompt_tokens) echoes the text of what was read
            shapes.echo_text(
                body, kind, None if cut_short else prompts[i // n], h.request.prompt, decode
            )
            for i, h in enumerate(handles)
        ]
        return handles, stream, shapes.stream_usage(body), token_ids, tooling, echoes

    async def events(
        handles: list[RequestHandle], ident: str, kind: str, usage_mode: str | None,
        token_ids: bool, as_ids: bool,
        echoes: list[str | None], tooling: tools.ToolCalling | None, n: int,
    ) -> AsyncIterator[str]:  # fmt: skip
        """Server-sent events: a chunk per delta of each choice (its ``index``; a required
        tool call's in one chunk once whole), a last one of
        each with its finish reason and speculative stats, and, where
        ``stream_options.include_usage`` asked, one with no choices and the usage (as OpenAI
        sends it). A client that goes away cancels the requests (their iterators close). With
        the usage asked for, every other chunk has ``"usage": null``, as OpenAI's, or, asked
        ``"continuous"``, its choice's so far (`shapes.stream_usage`), as vLLM's."""

        prompts = [handle.request.prompt for handle in handles]
        extras = StreamExtras(kind, usage_mode, token_ids, prompts)
        try:
            if kind == CHAT:  # the role comes first, as OpenAI sends it
                for index in range(len(handles)):
                    yield sse(extras(chunk(ident, kind, None, None, index=index), index))
            logprobs = [shapes.StreamedLogprobs(kind, decode, as_ids) for _ in handles]
            texts = [tools.StreamedText(tooling) for _ in handles]  # (tool calls held back)
            echoed: set[int] = set()
            async for index, delta in merged(handles):
                if echoes[index] is not None and index not in echoed:  # its prompt first
                    echoed.add(index)
                    part = extras(chunk(ident, kind, echoes[index], None, index=index), index)
                    entries = handles[index].prompt_logprobs
                    if entries is not None:
                        entries = echoed_entries(handles[index].request.prompt, entries)
                        part["choices"][0]["logprobs"] = logprobs[index].body(entries)
                    yield sse(part)
                if delta is not None:
                    extras.came(index, delta.token_ids)
                    text = texts[index].push(delta.text)
                    if text or not texts[index].filters:
                        part = extras(chunk(ident, kind, text, None, index=index), index)
                        if delta.logprobs is not None:  # the tokens that came with this text
                            part["choices"][0]["logprobs"] = logprobs[index].body(delta.logprobs)
                        yield sse(part)
                    continue
                result = handles[index].result()
                reason = result.finish_reason
                extras.finished(index, result.token_ids)
                if tooling is not None:
                    text, calls = texts[index].finish(result.text)
                    if text:
                        yield sse(extras(chunk(ident, kind, text, None, index=index), index))
                    if calls:
                        part = extras(chunk(ident, kind, "", None, index=index), index)
                        part["choices"][0]["delta"] = tools.streamed_calls(calls)
                        reason = "tool_calls"
                        yield sse(part)
                final = extras(chunk(ident, kind, "", reason, index=index), index)
                final["speculative_decoding"] = spec_stats([result])
                yield sse(final)
            results = [handle.result() for handle in handles]
        except SpecrtError as exc:
            yield sse({"error": {"message": str(exc), "type": "server_error"}})
            return
        if usage_mode:
            yield sse(
                {**chunk(ident, kind, None, None), "choices": [], "usage": answer_usage(results, n)}
            )
        yield "data: [DONE]\n\n"

    def chunk(
        ident: str,
        kind: str,
        text: str | None,
        finish_reason: str | None,
        final: bool = False,
        index: int = 0,
    ) -> dict:
        return completion(ident, kind, model_name, text, finish_reason, final, index)

    def chat_prompt(messages: object, tools: list[dict] | None, how: Rendering) -> list[int]:
        """The conversation rendered by the bundle's chat template, as token ids (the template
        writes the special tokens itself, and the tools where it writes them)."""
        try:
            text = template.prompt(messages, tools, how)
        except ChatTemplateError as exc:
            raise HttpError(400, str(exc), "invalid_request_error", "messages") from exc
        return tokenizer.encode(text, add_special_tokens=False)

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/models/{name:path}", one_model),
        Route("/metrics", metrics_page),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        *tokenizer_routes(model_name, tokenizer, template, max_model_len, json_body),
    ]
    # outermost: 401s counted too
    middleware = [Middleware(CountAnswers, metrics=metrics, routes=routes)]
    middleware += [Middleware(BearerKey, key=api_key)] if api_key else []
    handlers = {HTTPException: unknown_route}
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)


_DEFAULTED = ("num_draft_tokens", "draft_schedule", "ignore_eos", "proposer")  # the server's

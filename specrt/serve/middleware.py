"""The server's plain ASGI middleware: answers counted by route and status, and the API key
the /v1 routes ask for. Plain ASGI, so streamed answers and client disconnects pass through
untouched."""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.routing import Match, Route

from specrt.serve.metrics import Metrics


class CountAnswers:
    """Counts every HTTP answer by route, method and status class (`Metrics.answered`), the
    route named by its path template as vLLM's instrumentator names it. Plain ASGI: it only
    watches the answer's first message, streamed or not."""

    def __init__(self, app, metrics: Metrics, routes: list[Route]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # a route that matches but for the method (a 405) names it too
        handler = next((r.path for r in self.routes if r.matches(scope)[0] != Match.NONE), "none")

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.answered(handler, scope["method"], message["status"])
            await send(message)

        await self.app(scope, receive, counted)


class BearerKey:
    """The /v1 routes answer only requests with ``Authorization: Bearer <key>`` (as OpenAI and
    vLLM's ``--api-key``); /health and /metrics stay open for probes and scrapers. Plain ASGI,
    so streamed answers and client disconnects pass through untouched."""

    def __init__(self, app, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "missing or wrong API key: send it as Authorization: Bearer <key>"
                response = JSONResponse(
                    {"error": {"message": message, "type": "invalid_request_error",
                               "param": None, "code": "invalid_api_key"}},
                    status_code=401,
                )  # fmt: skip
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

"""The server's OpenAI-style error answers, shared by its routes: every refusal is a JSON
body an OpenAI client can show (``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specrt.openai_shapes import CHAT, COMPLETION, error_body
from specrt.serve.request_log import ROUTES


class HttpError(Exception):
    """A request refused with ``status``: raised where the refusal is found, answered by the
    route (`error`)."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def error(
    status: int, message: str, kind: str, param: str | None = None, code: str | None = None
) -> Response:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def refused(exc: HttpError) -> Response:
    return error(exc.status, str(exc), exc.kind, exc.param)


def check_model(body: dict, model_name: str) -> None:
    """A body naming another model is a 404 (null, as any field: the default)."""
    if body.get("model") not in (None, model_name):
        raise HttpError(
            404,
            f"model {json.dumps(body['model'])} is not served here (this is "
            f"{json.dumps(model_name)})",
            "not_found_error",
            "model",
        )


async def unknown_route(request: Request, exc: HTTPException) -> Response:
    """A route or method this server does not have: an OpenAI error body (OpenAI answers
    "Invalid URL"), not Starlette's plain text, which OpenAI clients cannot show."""
    message = (
        f"Invalid URL ({request.method} {request.url.path}): this server answers POST "
        f"{ROUTES[COMPLETION]}, POST {ROUTES[CHAT]}, POST /v1/responses, GET /v1/models, POST "
        "/tokenize, POST /detokenize, GET /version, /health and /metrics"
    )
    response = error(exc.status_code, message, "invalid_request_error")
    response.headers.update(exc.headers or {})  # a 405's Allow
    return response

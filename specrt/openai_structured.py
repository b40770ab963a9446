"""Structured output in OpenAI and vLLM request bodies: OpenAI's ``response_format``, vLLM's
``structured_outputs`` and its older ``guided_*`` fields, read as one `StructuredOutput`
(`specrt.runtime.grammar`) for `specrt serve` and `specrt batch`'s OpenAI lines."""

from __future__ import annotations

import json

from specrt.errors import InvalidInputError, RequestError
from specrt.structured import StructuredOutput

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}  # fmt: skip
STRUCTURED = ("response_format", "structured_outputs", *GUIDED)
RESPONSE_FORMATS = (
    'use {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
    '{"name": ..., "schema": {...}}}'
)


def structured_output(body: dict):
    """The `StructuredOutput` a body asks for (None: none): ``response_format`` (``text``,
    ``json_object``, or ``json_schema`` with its ``schema``), vLLM's ``structured_outputs``
    (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) or one of its
    ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``. Raises
    `RequestError` naming the field, for a grammar that does not compile too."""
    given = [name for name in STRUCTURED if name in body]
    if len(given) > 1:
        message = f"{given[0]} and {given[1]} both ask for structured output: give one"
        raise RequestError(message, given[1])
    if not given:
        return None
    name, value = given[0], body[given[0]]
    if name in GUIDED:
        value = {GUIDED[name]: value}
    elif name == "response_format":
        value = _response_format(value)
        if value is None:
            return None
    try:
        found = StructuredOutput.of(value)
        found.check()
    except InvalidInputError as exc:
        raise RequestError(f"{name}: {exc}", name) from None
    return found


def _response_format(value: object) -> dict | None:
    """OpenAI's ``response_format`` as `StructuredOutput` fields (None: plain text)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    inner = value.get("json_schema") if kind == "json_schema" else None
    if isinstance(inner, dict) and isinstance(inner.get("schema", {}), dict):
        return {"json": inner.get("schema", {})}  # none: any JSON value, as OpenAI's empty one
    shown = json.dumps(value)[:200]
    raise RequestError(f"response_format={shown}: {RESPONSE_FORMATS}", "response_format")

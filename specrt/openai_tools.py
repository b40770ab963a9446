"""Tool calling in OpenAI chat bodies (``tools``, ``tool_choice``, ``parallel_tool_calls``) for
`specrt serve`. A call the body requires (``tool_choice: "required"``, or a function named) is
written under a JSON schema of the tools' parameters (structured output), so the answer is
still the target's own under that grammar; it comes back as the message's ``tool_calls``.
``"auto"`` would need each model's own call format read out of free text (vLLM's tool
parsers), which specrt does not have: it is refused in one line saying what to send."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from specrt.errors import InvalidInputError, RequestError
from specrt.structured import StructuredOutput

FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
TOOL_SHAPE = 'each tool is {"type": "function", "function": {"name": ..., "parameters": {...}}}'
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # none declared


@dataclass(frozen=True)
class ToolCalling:
    """What a chat body asks of its tools: ``tools`` as the chat template takes them; ``name``:
    the function a named ``tool_choice`` calls; ``required``: a call of one of them (or, with
    ``parallel``, several) is the answer; neither: text (``"none"``)."""

    tools: list[dict]
    name: str | None = None
    required: bool = False
    parallel: bool = True

    @property
    def calls_required(self) -> bool:
        return self.required or self.name is not None

    def structured_output(self) -> StructuredOutput | None:
        """The grammar the answer is written under: the named function's parameters, or a
        list of ``{"name", "arguments"}`` objects, one of the tools' each. Raises
        `RequestError` for parameters llguidance cannot compile."""
        structured = self._grammar()
        try:
            if structured is not None:
                structured.check()
        except InvalidInputError as exc:
            raise RequestError(f"tools: {exc}", "tools") from None
        return structured

    def _grammar(self) -> StructuredOutput | None:
        functions = {tool["function"]["name"]: tool["function"] for tool in self.tools}
        if self.name is not None:
            return StructuredOutput(json=_compact(_parameters(functions[self.name])))
        if not self.required:
            return None
        one_of = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": _parameters(function)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, function in functions.items()
        ]
        schema = {"type": "array", "items": {"anyOf": one_of}, "minItems": 1}
        schema = _compact(schema if self.parallel else {**schema, "maxItems": 1})
        return StructuredOutput(json=schema)

    def calls(self, text: str) -> list[dict] | None:
        """The answer's ``tool_calls`` as OpenAI gives them (None: the answer is not a whole
        call, e.g. cut short by max_tokens: it goes back as text)."""
        try:
            value = json.loads(text)
            if self.name is not None:
                calls = [(self.name, text.strip())]
            else:
                dump = json.dumps
                calls = [(c["name"], dump(c["arguments"], ensure_ascii=False)) for c in value]
        except (json.JSONDecodeError, TypeError, KeyError):  # not what the grammar writes
            return None
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            for name, arguments in calls
        ]


def _parameters(function: dict) -> dict:
    return function.get("parameters") or NO_PARAMETERS


def _compact(schema: dict) -> dict:
    """``schema`` written without whitespace between its tokens (unless it says otherwise,
    llguidance's ``x-guidance``): arguments, not a document, and a draft that writes
    newlines there would be followed for ever."""
    return {"x-guidance": {"whitespace_flexible": False}, **schema}


def read_tools(body: dict) -> tuple[ToolCalling | None, dict]:
    """What a chat body asks of tools (None: no tools) and the body without those fields.
    Raises `RequestError` naming the field."""
    given = {field: body[field] for field in FIELDS if body.get(field) is not None}
    rest = {key: value for key, value in body.items() if key not in FIELDS}
    tools, choice = given.get("tools", []), given.get("tool_choice")
    parallel = given.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if not isinstance(tools, list) or not all(_is_tool(tool) for tool in tools):
        raise RequestError(f"tools must be a list of functions: {TOOL_SHAPE}", "tools")
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) < len(names):
        raise RequestError("tools name a function twice: give each name once", "tools")
    if not tools:
        if choice not in (None, "none"):
            raise RequestError(f"tool_choice {json.dumps(choice)} needs tools", "tool_choice")
        return None, rest
    if choice is None or choice == "auto":
        raise RequestError(
            'tool_choice "auto" (the default with tools) lets the model choose between text '
            "and a call in its own format, which specrt does not read: send tool_choice "
            '"required", {"type": "function", "function": {"name": ...}} (a call written under '
            'the tools\' JSON schemas) or "none"',
            "tool_choice",
        )
    if choice == "none":
        return ToolCalling(tools, parallel=parallel), rest
    if choice == "required":
        return ToolCalling(tools, required=True, parallel=parallel), rest
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and name in names):
        raise RequestError(
            f'tool_choice={json.dumps(choice)[:200]}: use "none", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}} naming one of {names}',
            "tool_choice",
        )
    return ToolCalling(tools, name=name, parallel=parallel), rest


def _is_tool(tool: object) -> bool:
    function = tool.get("function") if isinstance(tool, dict) else None
    return (
        isinstance(tool, dict)
        and tool.get("type") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and isinstance(function.get("parameters", {}), dict)
    )


def with_tools(tooling: ToolCalling | None, options: dict) -> dict:
    """A request's `GenerationConfig` fields with the grammar its required call is written
    under. Raises `RequestError` where the body asks for another structured output, or for
    log-probabilities (which would describe the call's JSON, not text: not supported)."""
    if tooling is None or not tooling.calls_required:
        return options
    if "structured_output" in options:
        message = "response_format and a required tool call both constrain the answer: give one"
        raise RequestError(message, "response_format")
    if "logprobs" in options:
        message = "logprobs with a required tool call are not supported: leave logprobs out"
        raise RequestError(message, "logprobs")
    return {**options, "structured_output": tooling.structured_output()}


def answered_calls(tooling: ToolCalling | None, text: str) -> list[dict] | None:
    """The ``tool_calls`` of an answer (None: it is text)."""
    return tooling.calls(text) if tooling is not None and tooling.calls_required else None


def as_calls(choice: dict, calls: list[dict], stream: bool = False) -> None:
    """A chat choice (``stream``: a chunk's delta, each call with its ``index``) turned into
    its tool calls, as OpenAI gives them: no content, finish reason ``"tool_calls"``."""
    if stream:
        choice["delta"] = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
    else:
        choice["message"].update(content=None, tool_calls=calls)
        choice["finish_reason"] = "tool_calls"

"""Tool calling in OpenAI chat bodies (``tools``, ``tool_choice``, ``parallel_tool_calls``) for
`specrt serve` and batch files. A call the body requires (``tool_choice: "required"``, or a
function named) is written under a JSON schema of the tools' parameters (structured output), so
the answer is still the target's own under that grammar; it comes back as the message's
``tool_calls``. ``"auto"`` leaves the choice to the model, in its own format: read out of its
text by a parser the server is told of (``--tool-call-parser``, as vLLM's:
`specrt.tool_parsers`), refused in one line without one."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from specrt.errors import InvalidInputError, RequestError
from specrt.structured import StructuredOutput
from specrt.tool_parsers import FORMATS, json_of

FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
PARSERS = tuple(FORMATS)  # the call formats "auto" reads
TOOL_SHAPE = 'each tool is {"type": "function", "function": {"name": ..., "parameters": {...}}}'
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # none declared


@dataclass(frozen=True)
class ToolCalling:
    """What a chat body asks of its tools: ``tools`` as the chat template takes them; ``name``:
    the function a named ``tool_choice`` calls; ``required``: a call of one of them (or, with
    ``parallel``, several) is the answer; ``parser``: the model's own calls are read out of
    its text (``"auto"``); none of them: text (``"none"``)."""

    tools: list[dict]
    name: str | None = None
    required: bool = False
    parallel: bool = True
    parser: str | None = None

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

    def reply(self, text: str) -> tuple[str | None, list[dict]] | None:
        """The answer as the message's content and ``tool_calls``, as OpenAI gives them (None:
        text alone: no call, or one cut short by max_tokens). Where the model chose (``auto``),
        the content is its text before the first call (None if blank)."""
        if self.parser is not None:
            found = FORMATS[self.parser].split(text)
            calls = None if found is None or found[1] is None else _calls(found[1])
            if found is None or calls is None:
                return None  # no call, or one cut short
            return (found[0] if found[0].strip() else None), calls
        if not self.calls_required:
            return None
        if self.name is not None:
            return None if json_of(text) is None else (None, _calls([], self.name, text))
        return None if (calls := _calls(json_of(text))) is None else (None, calls)


def _calls(items: object, name: str | None = None, arguments: str = "") -> list[dict] | None:
    """OpenAI's ``tool_calls`` of ``[{"name", "arguments"}, ...]`` (or of the one call of
    ``name`` with ``arguments`` as written); None where ``items`` are not such calls."""
    if name is not None:
        calls = [(name, arguments.strip())]
    else:
        try:
            dump = json.dumps
            calls = [(c["name"], dump(c["arguments"], ensure_ascii=False)) for c in items]
        except (TypeError, KeyError):
            return None
        if not calls or not all(isinstance(name, str) for name, _ in calls):
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
    llguidance's ``x-guidance``): a call's arguments are read by a program, and a model free
    to write whitespace there may do so until max_tokens (the demo pair's code model did)."""
    return {"x-guidance": {"whitespace_flexible": False}, **schema}


def read_tools(body: dict, parser: str | None = None) -> tuple[ToolCalling | None, dict]:
    """What a chat body asks of tools (None: no tools) and the body without those fields;
    ``parser``: the format the model's own calls are read in (`PARSERS`; None: ``"auto"`` is
    refused). Raises `RequestError` naming the field."""
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
    if (choice is None or choice == "auto") and parser is not None:
        return ToolCalling(tools, parallel=parallel, parser=parser), rest
    if choice is None or choice == "auto":
        raise RequestError(
            'tool_choice "auto" (the default with tools) lets the model choose between text '
            "and a call in its own format, which this server was not told: start it with "
            "--tool-call-parser hermes where the model writes <tool_call> tags, or send "
            'tool_choice "required", {"type": "function", "function": {"name": ...}} (a call '
            'written under the tools\' JSON schemas) or "none"',
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
    calling = tooling is not None and (tooling.calls_required or tooling.parser is not None)
    if calling and "logprobs" in options:
        message = "logprobs with tool calls are not supported: leave logprobs out"
        raise RequestError(message, "logprobs")
    if tooling is not None and tooling.parser is not None and FORMATS[tooling.parser].special:
        options = {**options, "skip_special_tokens": False}  # its tags are special tokens
    if tooling is None or not tooling.calls_required:
        return options
    if "structured_output" in options:
        message = "response_format and a required tool call both constrain the answer: give one"
        raise RequestError(message, "response_format")
    return {**options, "structured_output": tooling.structured_output()}


def answered(tooling: ToolCalling | None, text: str) -> tuple[str | None, list[dict]] | None:
    """An answer's content and ``tool_calls`` (None: it is text alone)."""
    return None if tooling is None else tooling.reply(text)


def as_calls(choice: dict, reply: tuple[str | None, list[dict]]) -> None:
    """A chat choice turned into its content and tool calls, as OpenAI gives them (finish
    reason ``"tool_calls"``)."""
    content, calls = reply
    choice["message"].update(content=content, tool_calls=calls)
    choice["finish_reason"] = "tool_calls"


def streamed_calls(calls: list[dict]) -> dict:
    """A stream chunk's delta of ``calls`` (each with its ``index``)."""
    return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}


class StreamedText:
    """What of a streamed answer goes out as text as it comes: all of it, but a required
    call's (given whole at the end, as its calls) and, where the model chooses, what follows
    its first call's opening tag, and the end of the text while it could be one's start."""

    def __init__(self, tooling: ToolCalling | None) -> None:
        self.tooling = tooling
        self.text = ""
        self.sent = 0  # characters of ``text`` streamed
        self.held = tooling is not None and tooling.calls_required
        # whether text is held back at all (else every delta goes out as it comes)
        self.filters = self.held or (tooling is not None and tooling.parser is not None)

    def push(self, delta: str) -> str:
        """The text to stream now, ``delta`` received."""
        if not self.filters:
            return delta
        self.text += delta
        if self.held:
            return ""
        # (the model chooses: text until its calls may have begun)
        end = max(self.sent, FORMATS[self.tooling.parser].streamable(self.text))
        text, self.sent = self.text[self.sent : end], end
        return text

    def finish(self, text: str) -> tuple[str, list[dict] | None]:
        """The rest of the answer ``text`` to stream as text, and its calls (None: none)."""
        if not self.filters:
            return "", None  # all of it went out as it came
        reply = answered(self.tooling, text)
        if reply is None:
            return text[self.sent :], None
        content, calls = reply
        return (content or "")[self.sent :], calls

"""The formats a model writes its own tool calls in, read out of its text where a chat body
leaves the choice to it (``tool_choice: "auto"``), by the names vLLM's ``--tool-call-parser``
gives them:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` after any text
  (Hermes', Qwen 2.5's and 3's, SmolLM3's templates);
* ``llama3_json``: the answer is one JSON object ``{"name": ..., "parameters": {...}}``, or
  several separated by ``;`` (Llama 3.1's and 3.3's JSON tool calling; its ``<|python_tag|>``
  is a special token, left out of the text);
* ``pythonic``: the answer is a Python list of calls, ``[get_weather(city="Oslo"), now()]``
  (Llama 3.2's and 4's);
* ``mistral``: ``[TOOL_CALLS]`` after any text, then a JSON array of ``{"name", "arguments"}``
  (Mistral's tokenizers up to v7) or ``name[ARGS]{...}`` calls, each after its own
  ``[TOOL_CALLS]`` (v11 on). Those markers are special tokens: requests read in this format
  have their special tokens written into the text (``skip_special_tokens`` false, as vLLM's
  parser asks).

Each gives the text before the calls (the message's content) and the calls, or None where the
answer is text alone (no call, or one cut short), and says how much of a streamed answer may go
out as text before it is whole."""

from __future__ import annotations

import ast
import json

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_TAG = "<|python_tag|>"  # Llama's, where a tokenizer writes it as text


class Tagged:
    """A format whose calls follow a tag, after any text."""

    special = False  # whether its tags are special tokens, which the text must then show
    tag = ""

    def streamable(self, text: str) -> int:
        """How many of ``text``'s leading characters are text for sure: up to a call's tag, or
        to the end less what may be a tag's beginning."""
        at = text.find(self.tag)
        if at >= 0:
            return at
        for k in range(len(self.tag) - 1, 0, -1):
            if text.endswith(self.tag[:k]):
                return len(text) - k
        return len(text)


class Hermes(Tagged):
    tag = HERMES_OPEN

    def split(self, text: str) -> tuple[str, list[dict] | None] | None:
        """(the text before the first call, the calls: None where one is not whole JSON), or
        None: no call."""
        before, tag, rest = text.partition(HERMES_OPEN)
        if not tag:
            return None
        found = [part.partition(HERMES_CLOSE) for part in rest.split(HERMES_OPEN)]
        if not all(close for _, close, _ in found):
            return before, None  # the last cut short
        return before, [json_of(call) for call, _, _ in found]


class Mistral(Tagged):
    special, tag = True, MISTRAL_CALLS

    def split(self, text: str) -> tuple[str, list[dict] | None] | None:
        before, tag, rest = text.partition(MISTRAL_CALLS)
        if not tag:
            return None
        if rest.lstrip().startswith("["):  # [{"name": ..., "arguments": ...}, ...]
            calls = json_of(rest)
            if isinstance(calls, dict):
                calls = [calls]
            return before, calls if isinstance(calls, list) else None
        calls = []
        for part in rest.split(MISTRAL_CALLS):  # name[ARGS]{...}, a tag before each
            name, args, arguments = part.partition(MISTRAL_ARGS)
            arguments = json_of(arguments)
            if not args or arguments is None:  # cut short
                return before, None
            calls.append({"name": name.strip(), "arguments": arguments})
        return before, calls


class StartsWith:
    """A format whose calls are the whole answer, known by its first character (whitespace
    and Llama's python tag aside)."""

    special = False

    def __init__(self, first: str, read) -> None:
        self.first, self.read = first, read

    def _calls_text(self, text: str) -> str | None:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG):
            stripped = stripped[len(PYTHON_TAG) :].lstrip()
        return stripped if stripped.startswith(self.first) else None

    def split(self, text: str) -> tuple[str, list[dict] | None] | None:
        calls = self._calls_text(text)
        return None if calls is None else ("", self.read(calls))

    def streamable(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or PYTHON_TAG.startswith(stripped[: len(PYTHON_TAG)]):
            return 0  # not known yet: blank, or (the start of) the python tag
        return 0 if self._calls_text(text) is not None else len(text)


def json_of(text: str) -> object:
    """``text``'s JSON value (None: not JSON)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _json_objects(text: str) -> list[dict] | None:
    """``{"name": ..., "parameters": {...}}`` objects separated by ``;`` as calls (Llama names
    the arguments ``parameters``)."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    text = text.strip()
    while True:
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        if not isinstance(item, dict) or "name" not in item:
            return None
        arguments = item.get("parameters", item.get("arguments", {}))
        calls.append({"name": item["name"], "arguments": arguments})
        rest = text[at:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        at = len(text) - len(rest[1:].lstrip())


def _python_calls(text: str) -> list[dict] | None:
    """A Python list of calls with keyword arguments of literal values, as calls."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
        if not isinstance(tree, ast.List):
            return None
        calls = []
        for call in tree.elts:
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)) or call.args:
                return None
            if any(k.arg is None for k in call.keywords):  # f(**kwargs)
                return None
            arguments = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
            calls.append({"name": call.func.id, "arguments": arguments})
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


FORMATS = {
    "hermes": Hermes(),
    "llama3_json": StartsWith("{", _json_objects),
    "pythonic": StartsWith("[", _python_calls),
    "mistral": Mistral(),
}

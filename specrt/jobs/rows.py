"""The rows of a batch job's input: its lines read as they were when the job started (a
pipe spooled first), each parsed into a `Row` (our own lines or OpenAI batch-file lines), and
the ids checked before any work."""

from __future__ import annotations

import codecs
import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from specrt.chat import FIELDS as RENDERING_FIELDS
from specrt.chat import Rendering, read_rendering
from specrt.errors import InvalidInputError
from specrt.openai_shapes import (
    AS_IDS,
    CHAT,
    COMPLETION,
    MAX_N,
    RequestError,
    choices,
    echoed,
    read_request,
    scored_only,
)
from specrt.openai_token_ids import token_ids_asked
from specrt.openai_tools import ToolCalling, read_tools, with_tools
from specrt.prompts import COMPRESSED

ROW_OPTIONS = (
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "num_draft_tokens",
    "stop",
    "stop_token_ids",
    "proposer",
    "logprobs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "structured_output",  # {"json": {...}} / {"regex": ...} / {"choice": [...]} / ...
    "truncate_prompt_tokens",
)
OPENAI_URLS = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}


@dataclass
class Row:
    id: str | int  # as the line gives it (compared as text: 1 and "1" are one id)
    prompt: str | list[int] | None = None  # text, or token ids (an OpenAI completions body's)
    options: dict = field(default_factory=dict)
    error: str | None = None  # why the line cannot run
    messages: object = None  # a chat line's, in place of the prompt (checked when rendered)
    named: bool = True  # False: a line too broken to give its id, named "line N" instead
    openai: bool = False  # an OpenAI batch-file line ("custom_id", "body")
    n: int = 1  # choices of its prompt (an OpenAI body's "n")
    echo: bool = False  # an OpenAI completion's "echo": the prompt before the answer
    scored_only: bool = False  # echo with "max_tokens": 0 (the prompt alone)
    tools: ToolCalling | None = None  # an OpenAI chat body's tools (`specrt.openai_tools`)
    rendering: Rendering | None = None  # how an OpenAI chat body asks its messages rendered
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and answer's ids too
    as_ids: bool = False  # vLLM's return_tokens_as_token_ids: log-probabilities name ids


@contextmanager
def spooled(path: Path) -> Iterator[Path]:
    """``path`` where it can be read twice (the ids are checked before any work): a file as it
    is; stdin (``-``) or a pipe copied to a temporary file first, removed afterwards."""
    if str(path) == "-":
        source = sys.stdin.buffer
    else:
        try:
            mode = path.stat().st_mode
        except OSError:  # `read_rows` says what is wrong
            mode = stat.S_IFREG
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
            yield path
            return
        if not stat.S_ISFIFO(mode):
            raise InvalidInputError(
                f"input {path} is a device, not a JSONL file; give a file, or pipe it to --input -"
            )
        source = open(path, "rb")  # noqa: SIM115 - closed below
    handle, name = tempfile.mkstemp(prefix="specrt-input-", suffix=".jsonl")
    # Where /proc reopens it, the copy has no name from the start: a job killed with -9
    # leaves no copy of its input behind
    reopened = Path(f"/proc/self/fd/{handle}")
    unnamed = reopened.exists()
    if unnamed:
        os.unlink(name)
    try:
        with os.fdopen(handle, "wb", closefd=False) as spool, source:
            shutil.copyfileobj(source, spool, 1 << 20)
        yield reopened if unnamed else Path(name)
    finally:
        os.close(handle)
        if not unnamed:
            os.unlink(name)


def read_rows(
    path: Path, name: str | None = None, size: int | None = None, tool_parser: str | None = None
) -> Iterator[Row]:
    """The input's rows, one per non-blank line, parsed as they are read (``name``: the input
    as errors name it, where ``path`` is a spooled copy; ``size``: read its first ``size``
    bytes only, as it was when the job started; ``tool_parser``: `openai_row`'s). A line that
    is not UTF-8 is a bad row like a line that is not JSON (its own error record): one such
    line in a large file must not stop the job."""
    label = name or str(path)
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError as exc:
        raise InvalidInputError(f"input file {label} does not exist") from exc
    except IsADirectoryError as exc:
        raise InvalidInputError(f"input file {label} is a directory; give a JSONL file") from exc
    with handle:
        for number, data in enumerate(_lines(handle, size), 1):
            if number == 1:
                if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
                    raise InvalidInputError(
                        f"{label} is UTF-16 text; JSON Lines are UTF-8: save the file as UTF-8"
                    )
                for magic, (kind, tool) in COMPRESSED.items():
                    if data.startswith(magic):
                        raise InvalidInputError(
                            f"{label} is {kind}-compressed; give the JSONL itself, e.g. "
                            f"`{tool} -c {'FILE' if name else path} | specrt batch --input - ...`"
                        )
                data = data.removeprefix(codecs.BOM_UTF8)
            try:
                line = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                message = f"not UTF-8 text (byte {data[exc.start]:#04x} at column {exc.start + 1})"
                yield Row(f"line {number}", error=f"{message}; save the file as UTF-8", named=False)
                continue
            if line.strip():
                yield parse_row(line, f"line {number}", tool_parser)


def _lines(handle: IO[bytes], size: int | None) -> Iterator[bytes]:
    """The lines of ``handle`` in its first ``size`` bytes (None: all of them)."""
    if size is None:
        yield from handle
        return
    while size > 0 and (line := handle.readline(size)):
        size -= len(line)
        yield line


def input_size(path: Path) -> int | None:
    """How many bytes of the input a job reads: a file's size when the job starts (rows
    appended while it runs are for the next run); None for anything else."""
    try:
        info = path.stat()
    except OSError:
        return None  # `read_rows` says what is wrong
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def parse_row(line: str, fallback_id: str, tool_parser: str | None = None) -> Row:
    """One input line as a `Row`; a line that cannot run keeps an id and says why."""
    try:
        # Without its line break: an error at the line's end is placed there, not on a next line
        item = json.loads(line.rstrip("\r\n"), object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        return Row(fallback_id, error=f"not JSON ({exc.msg} at column {exc.colno})", named=False)
    except _DuplicateKey as exc:
        key, message = exc.args[0], f"the key {exc.args[0]!r} appears twice in the line"
        try:  # its id, where that is not the key
            row = row_from_item(json.loads(line), fallback_id)
        except (ValueError, RecursionError):
            row = Row(fallback_id, named=False)
        if key in ("id", "custom_id") or not row.named:
            return Row(fallback_id, error=message, named=False)
        return Row(row.id, error=message, openai=row.openai)
    except (ValueError, RecursionError) as exc:  # JSON, but beyond what Python reads
        return Row(fallback_id, error=f"JSON that cannot be read: {_beyond(exc)}", named=False)
    return row_from_item(item, fallback_id, tool_parser)


def _beyond(exc: Exception) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return "a number too long" if "digits" in str(exc) else str(exc)


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's keys, each once (json keeps the last of a repeated key silently)."""
    item = dict(pairs)
    if len(item) < len(pairs):
        keys = [key for key, _ in pairs]
        raise _DuplicateKey(next(key for key in keys if keys.count(key) > 1))
    return item


def row_from_item(item: object, fallback_id: str, tool_parser: str | None = None) -> Row:
    """A parsed input object (a JSON line, a dataset row) as a `Row`."""
    if not isinstance(item, dict):
        return Row(fallback_id, error="a line must be a JSON object", named=False)
    if "custom_id" in item and {"id", "prompt", "messages"} & set(item):
        return Row(
            fallback_id,
            error='a line is ours ("id", "prompt") or an OpenAI batch line ("custom_id", '
            '"body"), not both',
            named=False,
        )
    if "custom_id" in item:  # an OpenAI batch-file line
        return openai_row(item, fallback_id, tool_parser)
    if "messages" in item and item["messages"] is None:  # null: not given, as for settings
        item = {key: value for key, value in item.items() if key != "messages"}
    both = "max_tokens" in item and "max_new_tokens" in item
    if "max_tokens" in item and not both:  # OpenAI's name for it, which its users write first
        item = {("max_new_tokens" if k == "max_tokens" else k): v for k, v in item.items()}
    row_id = item.get("id")
    if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
        if "id" not in item and {"method", "url", "body"} & set(item):  # OpenAI's, unnamed
            return Row(fallback_id, error='an OpenAI batch line needs a "custom_id"', named=False)
        return Row(fallback_id, error='a line needs an "id" (a string or an integer)', named=False)
    # null: the default
    options = {key: item[key] for key in ROW_OPTIONS if item.get(key) is not None}
    prompt = item.get("prompt")
    row = Row(row_id, prompt if isinstance(prompt, str) else None, options)
    ours = {"id", "prompt", "messages", "max_tokens", *RENDERING_FIELDS}
    extra = sorted(set(item) - set(ROW_OPTIONS) - ours)
    chat_fields = [key for key in RENDERING_FIELDS if item.get(key) is not None]
    if both:
        row.error = 'a line gives "max_new_tokens" or "max_tokens" (its OpenAI name), not both'
    elif extra:
        known = ", ".join(["prompt", "messages", *ROW_OPTIONS])
        row.error = f"unknown field(s) {extra}; known: {known}"
    elif "prompt" in item and "messages" in item:
        row.error = 'a line gives a "prompt" or chat "messages", not both'
    elif "messages" in item:
        row.messages = item["messages"]
        try:  # how they are rendered, as an OpenAI body says it
            row.rendering, _ = read_rendering(item)
        except RequestError as exc:
            row.error = str(exc)
    elif chat_fields:
        row.error = f'{chat_fields[0]} renders chat "messages": a "prompt" is sent as it is'
    elif not isinstance(prompt, str):
        row.error = 'a line needs a "prompt" string (or chat "messages")'
    return row


def openai_row(item: dict, fallback_id: str, tool_parser: str | None = None) -> Row:
    """An OpenAI batch-file line (``custom_id``, ``method``, ``url``, ``body``) as a `Row`: its
    body read as `specrt serve` reads a request to ``url`` (by the body's keys where the line
    gives no url), but for the length, which the command line's defaults give; a chat's
    ``tool_choice: "auto"`` reads calls in ``tool_parser``'s format (None: refused)."""
    row_id, body, url = item["custom_id"], item.get("body"), item.get("url")
    if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
        return Row(fallback_id, error='"custom_id" must be a string', named=False, openai=True)
    row = Row(row_id, openai=True)
    if item.get("method", "POST") != "POST":
        row.error = f"method {item['method']!r}: the requests of a batch file are POSTs"
    elif url is not None and (not isinstance(url, str) or url not in OPENAI_URLS):
        row.error = f"url {url!r}: specrt batch answers {' and '.join(OPENAI_URLS)}"
    elif not isinstance(body, dict):
        row.error = '"body" must be an object (the request)'
    if row.error is not None:
        return row
    kind = OPENAI_URLS.get(url) or (CHAT if "messages" in body else COMPLETION)
    try:
        if kind == CHAT:
            row.tools, body = read_tools(body, tool_parser)
            row.rendering, body = read_rendering(body)
        row.token_ids, body = token_ids_asked(body)
        prompt, options = read_request(body, kind, default_max_tokens=None, max_n=MAX_N)
        row.options = with_tools(row.tools, options)
    except RequestError as exc:
        row.error = str(exc)
        return row
    row.n = choices(body)
    row.echo, row.scored_only = echoed(body, kind), scored_only(body)
    row.as_ids = bool(body.get(AS_IDS))
    if body.get("stream"):
        row.error = "a batch line cannot stream: leave stream out (or false)"
    elif body.get("priority") not in (None, 0) or isinstance(body.get("priority"), bool):
        row.error = (
            f"priority={json.dumps(body['priority'])}: a batch job runs its lines in the "
            "file's order; leave priority out (or 0), or order the lines"
        )
    elif kind == CHAT and prompt is None:
        row.error = 'a chat line needs "messages"'
    elif kind == CHAT:
        row.messages = prompt
    elif len(prompt) > 1:
        row.error = (
            f"prompt is a list of {len(prompt)} prompts: a batch line answers one; give each "
            "prompt a line of its own"
        )
    else:
        [row.prompt] = prompt
    return row


def check_ids(
    path: Path, name: str | None = None, size: int | None = None
) -> tuple[set[str], bool]:
    """Refuse duplicate ids before any work; the ids (as text), and whether the rows are all
    OpenAI batch-file lines (lines too broken to tell aside). ``size``: as `read_rows`."""
    seen: dict[str, Row] = {}
    forms = set()
    for row in read_rows(path, name, size):
        key = str(row.id)
        if key in seen:
            first = seen[key]
            why = "every row needs its own id (results are matched and resumed by id)"
            if not (row.named and first.named):
                why = f"a line too broken to read its id is named {key!r}; give the row another id"
            elif type(row.id) is not type(first.id):
                why = f"ids are compared as text: {first.id!r} and {row.id!r} are one id"
            raise InvalidInputError(f"{name or path}: id {row.id!r} appears twice; {why}")
        seen[key] = row
        if row.named:
            forms.add(row.openai)
    return set(seen), forms == {True}


def input_name(input_path: Path, rows: Path) -> str | None:
    """How errors name an input read through a spooled copy (stdin, a pipe); None: as is."""
    if rows == input_path:
        return None
    return "standard input" if str(input_path) == "-" else str(input_path)

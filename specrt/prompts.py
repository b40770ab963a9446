"""Prompt files, read one way for the CLI, the benchmarks and the demo scripts.

A ``.jsonl`` file (any case) holds one JSON value per line: ``{"prompt": "..."}`` or a JSON string
(prompts that span lines), or, for a chat, ``{"messages": [...]}`` (OpenAI's form, rendered with
the bundle's chat template by the caller); any other file holds one prompt per line. Blank lines
are skipped.
Files are UTF-8 (a byte-order mark is dropped) or UTF-16 with a byte-order mark; ``-`` reads
standard input, and pipes and process substitutions read like files.
This module imports nothing beyond the standard library (the onnxruntime-genai benchmark reads
prompts with it from its own environment).
"""

from __future__ import annotations

import codecs
import json
import os
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from specrt import json_text
from specrt.errors import InvalidInputError

STDIN = "-"
# What `specrt batch` reads per row: found in a prompt file, refused rather than ignored.
ROW_SETTINGS = {
    "max_new_tokens", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop",
    "num_draft_tokens", "proposer", "draft_schedule",
}  # fmt: skip


def read_prompt_file(path: str | Path, chat: bool | None = False) -> list:
    """The prompts of ``path``; `InvalidInputError` naming the file and line for anything else.
    ``chat``: a line may hold ``{"messages": [...]}``, returned as that list (checked when the
    chat template renders it); None: the command has no --chat to offer."""
    name = str(path)
    lines = read_text(name).splitlines()
    if not name.lower().endswith(".jsonl"):
        return [line for line in lines if line.strip()]
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json_text.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{name}:{number} is not JSON ({exc})") from exc
        if isinstance(item, dict) and "messages" in item and "prompt" not in item:
            if not chat:
                raise InvalidInputError(
                    f"{name}:{number} holds chat messages: add --chat to render them with the "
                    "bundle's chat template"
                    if chat is not None
                    else f"{name}:{number} holds chat messages, which this command does not "
                    'take: write {"prompt": "..."} lines (rendered as a user\'s message)'
                )
            item = item["messages"]
            if not isinstance(item, list):
                raise InvalidInputError(
                    f'{name}:{number}: "messages" must be a list of {{"role", "content"}} '
                    f"objects, not {_json_kind(item)}"
                )
            prompts.append(item)
            continue
        if isinstance(item, dict):
            if "prompt" not in item:
                raise InvalidInputError(
                    f'{name}:{number} has no "prompt" key (keys: {sorted(item)[:5]}); '
                    'write {"prompt": "..."}'
                )
            settings = sorted(ROW_SETTINGS & set(item))
            if settings:  # silently ignored, they would give another output than asked for
                raise InvalidInputError(
                    f"{name}:{number} sets {', '.join(settings)}: prompt files hold prompts; "
                    "give settings as options (--max-new-tokens ...), or run the file with "
                    "`specrt batch`, which reads them per row"
                )
            item = item["prompt"]
        if not isinstance(item, str):
            raise InvalidInputError(
                f"{name}:{number}: a prompt must be a JSON string, not {_json_kind(item)}"
            )
        prompts.append(item)
    return prompts


def collect_prompts(
    prompts: Sequence[str] = (),
    prompt_file: str | Path | Sequence[str | Path] | None = None,
    chat: bool | None = False,
) -> list:
    """Prompts given one by one, then those of each ``prompt_file`` (one path or several, in
    order); at least one (``chat``: a file's lines may be conversations, see
    `read_prompt_file`)."""
    collected = list(prompts)
    files = [prompt_file] if isinstance(prompt_file, (str, Path)) else list(prompt_file or ())
    for name in files:
        from_file = read_prompt_file(name, chat)
        if not from_file:
            where = "standard input" if str(name) == STDIN else f"prompt file {name}"
            raise InvalidInputError(f"{where} holds no prompts")
        collected += from_file
    if not collected:
        raise InvalidInputError("give a prompt with --prompt TEXT or --prompt-file FILE")
    return collected


def _read_bytes(name: str, what: str = "prompt file") -> bytes:
    if name == STDIN:
        return sys.stdin.buffer.read()
    try:
        with open(name, "rb") as handle:  # not Path.is_file(): pipes are files to read too
            if stat.S_ISCHR(os.fstat(handle.fileno()).st_mode) and not handle.isatty():
                raise InvalidInputError(  # /dev/zero would be read forever
                    f"{what} {name} is a device, not a file; give a file, or pipe it in as -"
                )
            return handle.read()
    except FileNotFoundError as exc:
        raise InvalidInputError(f"{what} {name} does not exist") from exc
    except IsADirectoryError as exc:
        raise InvalidInputError(f"{what} {name} is a directory; give a file") from exc
    except OSError as exc:
        raise InvalidInputError(f"cannot read {what} {name}: {exc.strerror}") from exc


# Inputs that are archives, not text (their first bytes): named instead of read as bad text.
COMPRESSED = {b"\x1f\x8b": ("gzip", "gunzip"), b"BZh": ("bzip2", "bunzip2"),
              b"\xfd7zXZ": ("xz", "unxz"), b"\x28\xb5\x2f\xfd": ("zstd", "unzstd")}  # fmt: skip


def read_text(name: str, what: str = "prompt file") -> str:
    """A text file's content (UTF-8, or UTF-16 with its byte-order mark; "-": stdin), or one
    line saying why it cannot be read as text."""
    return _decode(_read_bytes(name, what), name)


def _decode(data: bytes, name: str) -> str:
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError as exc:
            raise InvalidInputError(f"{name} is not valid UTF-16 text ({exc.reason})") from exc
    for magic, (kind, tool) in COMPRESSED.items():
        if data.startswith(magic):
            raise InvalidInputError(
                f"{name} is {kind}-compressed: give the text itself (`{tool} {name}` first)"
            )
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InvalidInputError(
            f"{name}:{line} is not UTF-8 text (byte {data[exc.start]:#04x}); save the file as UTF-8"
        ) from exc
    if "\x00" in text:  # text has no NUL: UTF-16 without its mark, or not text at all
        line = data.count(b"\n", 0, data.index(b"\x00")) + 1
        raise InvalidInputError(
            f"{name}:{line} holds a NUL byte: not text, or UTF-16 without a byte-order mark; "
            "save the file as UTF-8"
        )
    return text


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"

"""`specrt batch`: an offline job from a JSONL file of prompts to a JSONL file of results.

Input lines are ``{"id": ..., "prompt": "...", optional "max_new_tokens", "temperature",
"top_k", "top_p", "seed", "num_draft_tokens", "stop"}``, or OpenAI batch-file lines
(``custom_id``, ``method``, ``url``, ``body``: the body read as `specrt serve` reads that
request); ``messages`` (OpenAI's chat form) in place of ``prompt`` is rendered with the bundle's
chat template. The input is
streamed (bounded memory but for the set of ids), as it was when the job started: lines
appended while it runs are left to the next run; each finished row is written and flushed at
once as ``{"id", "text", "token_ids", "finish_reason", "stats"}``, or ``{"id", "error"}`` for a
row that cannot run (malformed, too long, a bad parameter): the job goes on. An input of OpenAI
lines alone gets OpenAI's batch output lines instead (`openai_batch`). While a job runs, its
output is its own (a lock the kernel lets go of however the job ends).

Crash-safe: rerunning the same command after a crash or ``kill -9`` skips the ids already in
the output, so no row is lost or written twice; a last line torn by the crash is cut off and
its row done again. Duplicate ids in the input are refused before any work. Stdin and pipes
are spooled to a temporary file first; an output that is a pipe or a device (stdout,
/dev/null) is written but cannot be resumed.
"""

from __future__ import annotations

import codecs
import fcntl
import functools
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO

from specrt.errors import InvalidInputError
from specrt.jobs import openai_batch
from specrt.openai_shapes import CHAT, COMPLETION, RequestError, read_request
from specrt.runtime.batching import Request
from specrt.runtime.config import GenerationConfig
from specrt.runtime.generator import SpeculativeGenerator, row_rng

ROW_OPTIONS = (
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "num_draft_tokens",
    "stop",
    "proposer",
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


@dataclass
class Summary:
    rows: int = 0  # in the input
    ok: int = 0
    failed: int = 0
    skipped: int = 0  # already in the output from an earlier run
    skipped_errors: int = 0  # of them, error records
    new_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    wall_time_s: float = 0.0
    batch_size: int = 1  # rows per model call, at most
    cache_bytes: int = 0  # KV cache reserved at the end, both models, all rows
    cache_bytes_per_row: int = 0  # what one row's cache can grow to (at max length)
    proposers: dict[str, dict] = field(default_factory=dict)  # as GenerationStats.proposers
    suffix_cache_tokens: int = 0  # kept by the suffix cache at the end (when on)
    suffix_cache_bytes: int = 0
    other_record_count: int = 0  # records in the output of ids not in the input
    other_records: list[str] = field(default_factory=list)  # the first few of those ids
    output_format: str = "specrt"  # of the records: "specrt" or "openai"

    def add(self, record: dict) -> None:
        """Count a row written by this run."""
        if "error" in record:
            self.failed += 1
            return
        stats = record["stats"]
        self.ok += 1
        self.new_tokens += stats["new_tokens"]
        self.drafted_tokens += stats["drafted_tokens"]
        self.accepted_tokens += stats["accepted_tokens"]
        for source, entry in stats.get("proposers", {}).items():
            total = self.proposers.setdefault(source, {"rounds": 0, "proposed": 0, "accepted": 0})
            for name in total:
                total[name] += entry[name]

    @property
    def all_ok(self) -> bool:
        """No error record in the output, from this run or an earlier one."""
        return not (self.failed or self.skipped_errors)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "tokens_per_second": self.tokens_per_second,
            "acceptance_rate": self.acceptance_rate,
        }


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


def read_rows(path: Path, name: str | None = None, size: int | None = None) -> Iterator[Row]:
    """The input's rows, one per non-blank line, parsed as they are read (``name``: the input
    as errors name it, where ``path`` is a spooled copy; ``size``: read its first ``size``
    bytes only, as it was when the job started). A line that is not UTF-8 is a bad row
    like a line that is not JSON (its own error record): one such line in a large file must
    not stop the job."""
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
                yield parse_row(line, f"line {number}")


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


# Inputs that are archives, not text (their first bytes): named instead of read as bad lines.
COMPRESSED = {b"\x1f\x8b": ("gzip", "gunzip"), b"BZh": ("bzip2", "bunzip2"),
              b"\xfd7zXZ": ("xz", "unxz"), b"\x28\xb5\x2f\xfd": ("zstd", "unzstd")}  # fmt: skip


def parse_row(line: str, fallback_id: str) -> Row:
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
    return row_from_item(item, fallback_id)


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


def row_from_item(item: object, fallback_id: str) -> Row:
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
        return openai_row(item, fallback_id)
    if "messages" in item and item["messages"] is None:  # null: not given, as for settings
        item = {key: value for key, value in item.items() if key != "messages"}
    row_id = item.get("id")
    if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
        return Row(fallback_id, error='a line needs an "id" (a string or an integer)', named=False)
    # null: the default
    options = {key: item[key] for key in ROW_OPTIONS if item.get(key) is not None}
    prompt = item.get("prompt")
    row = Row(row_id, prompt if isinstance(prompt, str) else None, options)
    extra = sorted(set(item) - set(ROW_OPTIONS) - {"id", "prompt", "messages"})
    if extra:
        known = ", ".join(["prompt", "messages", *ROW_OPTIONS])
        row.error = f"unknown field(s) {extra}; known: {known}"
    elif "prompt" in item and "messages" in item:
        row.error = 'a line gives a "prompt" or chat "messages", not both'
    elif "messages" in item:
        row.messages = item["messages"]
    elif not isinstance(prompt, str):
        row.error = 'a line needs a "prompt" string (or chat "messages")'
    return row


def openai_row(item: dict, fallback_id: str) -> Row:
    """An OpenAI batch-file line (``custom_id``, ``method``, ``url``, ``body``) as a `Row`: its
    body read as `specrt serve` reads a request to ``url`` (by the body's keys where the line
    gives no url), but for the length, which the command line's defaults give."""
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
        prompt, row.options = read_request(body, kind, default_max_tokens=None)
    except RequestError as exc:
        row.error = str(exc)
        return row
    if body.get("stream"):
        row.error = "a batch line cannot stream: leave stream out (or false)"
    elif kind == CHAT and prompt is None:
        row.error = 'a chat line needs "messages"'
    elif kind == CHAT:
        row.messages = prompt
    else:
        row.prompt = prompt
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


def done_ids(output: Path, output_format: str = "specrt", mend: bool = True) -> dict[str, bool]:
    """Ids already in ``output``, each with whether its record is an error, read line by line
    (a million-row job's output need not fit in memory). A last line without its newline that
    begins as every record does but is not one whole (a crash mid-write) is cut off, and its
    row runs again; a whole record without its newline is kept and ended. Any
    other line that is not a result record means the file is not ours: it is refused and
    left as it is, as is a file of records in the other ``output_format``. A pipe or a
    device (stdout, /dev/null) cannot be read back: nothing is done. ``mend=False``: the
    file is only read."""
    if not output.is_file():
        return {}
    ids, kept, torn, unended = {}, 0, False, False
    with open(output, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():  # a record's line emptied by hand: its row runs again
                kept += len(line)
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                record = None
            if not line.endswith(b"\n"):  # the last line, without its newline
                if record is None and (
                    line.startswith(RECORD_START) or RECORD_START.startswith(line)
                ):
                    torn = True
                    break
                unended = True  # whole but for its newline (kept, ended), or not ours
            if is_result(record) and output_format == "specrt":
                ids[str(record["id"])] = "error" in record
            elif openai_batch.is_record(record) and output_format == "openai":
                ids[str(record["custom_id"])] = openai_batch.failed(record)
            elif is_result(record) or openai_batch.is_record(record):
                raise _other_format(output, number, output_format)
            else:
                raise _not_ours(output, number)
            kept += len(line)
    if torn and mend:
        with open(output, "r+b") as handle:
            handle.truncate(kept)
    elif unended and mend:
        with open(output, "ab") as handle:
            handle.write(b"\n")
    return ids


# How every line `run_batch` writes begins (`json.dumps` of a record whose first key is "id").
RECORD_START = b'{"id": '
RESULT_KEYS = {"text", "token_ids", "finish_reason", "stats"}


def is_result(record: object) -> bool:
    """Whether ``record`` is a line `run_batch` writes: a result or a row's error."""
    if not isinstance(record, dict) or "id" not in record:
        return False
    if "error" in record:
        return set(record) == {"id", "error"} and isinstance(record["error"], dict)
    return RESULT_KEYS <= set(record)


def _other_format(output: Path, line: int, output_format: str) -> InvalidInputError:
    other = "specrt" if output_format == "openai" else "openai"
    name = "standard output (--output -)" if str(output) == "/dev/stdout" else str(output)
    return InvalidInputError(
        f"{name} holds records of --output-format {other} (line {line}), not {output_format}: "
        f"rerun with --output-format {other} to go on with it, or give another --output"
    )


def _not_ours(output: Path, line: int) -> InvalidInputError:
    if str(output) == "/dev/stdout":  # --output - into a file (`>> out.jsonl`): resumed too
        return InvalidInputError(
            f"standard output (--output -) is a file whose line {line} is not a result of "
            "specrt batch; send it elsewhere (the file is left as it is)"
        )
    return InvalidInputError(
        f"{output} line {line} is not a result of specrt batch; give another --output (this "
        "one is left as it is)"
    )


def preflight(
    input_path: str | Path,
    output_path: str | Path,
    output_format: str = "auto",
    input_name: str | None = None,
) -> None:
    """What `run_batch` refuses, found before a model is loaded for it (a large one takes
    minutes): duplicate ids, an output that another job is writing, that is not ours or that
    holds the other format's records. Reads both files, writes nothing."""
    _, openai_lines = check_ids(Path(input_path), input_name)
    if output_format == "auto":
        output_format = "openai" if openai_lines else "specrt"
    output_path = Path(output_path)
    if output_path.is_file():
        with open(output_path, "rb") as handle:
            _lock(handle, output_path)  # let go at once: `run_batch` takes it for the job
    done_ids(output_path, output_format, mend=False)


def run_batch(
    generator: SpeculativeGenerator,
    input_path: str | Path,
    output_path: str | Path,
    defaults: GenerationConfig | None = None,
    progress: Callable[[Summary, int], None] = lambda summary, total: None,
    output_format: str = "auto",
    model: str = "specrt",
    input_name: str | None = None,
) -> Summary:
    """Run every row of ``input_path`` not yet in ``output_path``, appending its result as it
    finishes (rows share model calls when the generator was loaded with ``max_batch`` > 1, so
    they finish out of input order). ``output_format``: "specrt" (our records), "openai"
    (OpenAI's batch output lines, ``model`` named in their bodies) or "auto" (openai when every
    row is an OpenAI batch-file line). ``input_name``: the input as errors name it (standard
    input, spooled to a file)."""
    if output_format not in openai_batch.OUTPUT_FORMATS:
        raise InvalidInputError(
            f"output_format must be one of {', '.join(openai_batch.OUTPUT_FORMATS)}, not "
            f"{output_format!r}"
        )
    input_path, output_path = Path(input_path), Path(output_path)
    if defaults is None:
        defaults = GenerationConfig()
    elif not isinstance(defaults, GenerationConfig):
        raise InvalidInputError(
            f"defaults must be a GenerationConfig, not {type(defaults).__name__}"
        )
    if output_path.is_dir():
        raise InvalidInputError(f"the output {output_path} is a directory; give a file")
    size = input_size(input_path)  # the input as it is now: lines appended later wait
    ids, openai_lines = check_ids(input_path, input_name, size)
    if output_format == "auto":
        output_format = "openai" if openai_lines else "specrt"
    total = len(ids)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with open(output_path, "a", encoding="utf-8") as out:
        _lock(out, output_path)  # before reading what is done: two jobs would both do the rest
        finished = done_ids(output_path, output_format)
        summary = Summary(rows=total, batch_size=generator.max_batch, output_format=output_format)
        chats: set[str] = set()  # rows in flight that are chat lines (their answers are chat's)
        # Records of ids the input no longer has (a broken line since mended, rows removed)
        summary.other_records = sorted(set(finished) - ids)[:3]
        summary.other_record_count = len(set(finished) - ids)
        unrun = ids - set(finished)  # each runs once: an id met again is never written twice
        started = time.perf_counter()

        def write(record: dict, status: int = 200) -> None:
            line = record
            if output_format == "openai":
                chat = str(record["id"]) in chats
                line = openai_batch.record(record["id"], record, chat, model, status)
            chats.discard(str(record["id"]))
            text = json.dumps(line, ensure_ascii=False)
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:  # a lone surrogate (JSON's "\\ud800"): kept escaped
                    text = json.dumps(line)
            out.write(text + "\n")
            out.flush()  # a row is done once it is in the file: a kill -9 cannot lose it
            summary.add(record)
            summary.wall_time_s = time.perf_counter() - started
            progress(summary, total)

        def requests() -> Iterator[Request]:
            """The rows to run, read as slots free up; the others are settled on the way."""
            for row in read_rows(input_path, input_name, size):
                if str(row.id) in finished:
                    summary.skipped += 1
                    summary.skipped_errors += finished[str(row.id)]
                    progress(summary, total)
                    continue
                if str(row.id) not in unrun:  # the input was rewritten under the job
                    continue
                unrun.discard(str(row.id))
                if row.messages is not None:
                    chats.add(str(row.id))
                request = make_request(generator, row, defaults)
                if isinstance(request, dict):
                    write(request, 400)
                else:
                    yield request

        for key, result in generator.run(requests()):
            write({"id": key, **result.to_dict()}, 500 if result.error else 200)
        if output_path.is_file():  # pipes and devices have nothing to sync
            os.fsync(out.fileno())
    summary.wall_time_s = time.perf_counter() - started
    decoders = (generator.target, getattr(generator.drafter, "decoder", None))
    summary.cache_bytes = sum(getattr(d, "cache_bytes", 0) for d in decoders)
    summary.cache_bytes_per_row = sum(getattr(d, "cache_bytes_per_row", 0) for d in decoders)
    if generator.suffix_cache is not None:
        summary.suffix_cache_tokens = generator.suffix_cache.tokens
        summary.suffix_cache_bytes = generator.suffix_cache.memory_bytes()
    return summary


def _lock(out: IO, output_path: Path) -> None:
    """Hold the output for this job alone (the kernel lets go when the process ends, however
    it ends): a second job on it, a rerun started while the first still runs, would run the
    rows left again and write them twice."""
    if not output_path.is_file():  # a pipe or a device: nothing to resume, nothing to share
        return
    try:
        fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        name = "standard output" if str(output_path) == "/dev/stdout" else str(output_path)
        raise InvalidInputError(
            f"another specrt batch is writing {name}; wait for it to finish (or stop it), then "
            "run this again to go on from where it is"
        ) from exc


def make_request(generator: SpeculativeGenerator, row: Row, defaults: GenerationConfig):
    """The row as a `Request` (its prompt tokenized and checked, its config and own random
    stream), or its error record."""
    if row.error is not None:
        return {"id": row.id, "error": {"message": row.error}}
    try:
        config = replace(defaults, **row.options)
        if "seed" not in row.options and config.seed is not None:
            config = replace(config, seed=row_seed(config.seed, row.id))
        text = row.prompt if row.messages is None else chat_prompt(generator, row.messages)
        [prompt] = generator.encode_prompts([text])
    except InvalidInputError as exc:
        return {"id": row.id, "error": {"message": str(exc)}}
    return Request(row.id, prompt, config, row_rng(config, 0))


def chat_prompt(generator: SpeculativeGenerator, messages: object) -> list[int]:
    """A chat row's messages rendered by the bundle's chat template, as token ids (the
    template writes the special tokens itself, as `specrt serve` reads them)."""
    tokenizer = generator.tokenizer
    template = _chat_template(tokenizer.directory) if tokenizer is not None else None
    if template is None:
        raise InvalidInputError(
            'this bundle\'s tokenizer has no chat template: give a "prompt" instead of "messages"'
        )
    from specrt.chat import ChatTemplateError

    try:
        return tokenizer.encode(template.prompt(messages), add_special_tokens=False)
    except ChatTemplateError as exc:
        raise InvalidInputError(str(exc)) from exc


@functools.cache
def _chat_template(directory: Path):
    """The bundle's chat template, read once per job (a broken one stops the job: every chat
    row would fail the same way)."""
    try:
        from specrt.chat import ChatTemplate

        return ChatTemplate.from_directory(directory)
    except ImportError as exc:
        raise InvalidInputError(
            f"chat rows need jinja2 ({exc.name} is missing): pip install 'specrt[serve]'"
        ) from exc


def run_row(generator: SpeculativeGenerator, row: Row, defaults: GenerationConfig) -> dict:
    """One row alone, as `run_batch` writes it."""
    request = make_request(generator, row, defaults)
    if isinstance(request, dict):
        return request
    [(_, result)] = generator.run([request])
    return {"id": row.id, **result.to_dict()}


def row_seed(seed: int, row_id: str) -> int:
    """The job's seed made the row's own: rows draw from independent streams, and a row's
    tokens do not depend on its place in the file or on the rows run before it (a resumed job
    gives what an uninterrupted one would)."""
    digest = hashlib.sha256(f"{seed}\0{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def progress_bar(enabled: bool | None = None) -> Callable[[Summary, int], None]:
    """A tqdm bar on a terminal (rows done / total, tokens/s, acceptance); quiet elsewhere."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return lambda summary, total: None
    from tqdm import tqdm

    bar = None

    def update(summary: Summary, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit="row", file=sys.stderr)
        bar.n = summary.ok + summary.failed + summary.skipped
        bar.set_postfix(
            tokens_per_s=f"{summary.tokens_per_second:.0f}",
            acceptance=f"{summary.acceptance_rate:.2f}",
            failed=summary.failed,
            refresh=False,
        )
        bar.refresh()
        if bar.n >= total:
            bar.close()

    return update

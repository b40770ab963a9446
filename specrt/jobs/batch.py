"""`specrt batch`: an offline job from a JSONL file of prompts to a JSONL file of results.

Input lines are ``{"id": ..., "prompt": "...", optional "max_new_tokens", "temperature",
"top_k", "top_p", "seed", "num_draft_tokens", "stop"}``, or OpenAI batch-file lines
(``custom_id``, ``method``, ``url``, ``body``: the body read as `specrt serve` reads that
request; its ``n`` choices come back in one line); ``messages`` (OpenAI's chat form) in place
of ``prompt`` is rendered with the bundle's chat template. The input is
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

import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from specrt.chat import ChatTemplateError, Rendering
from specrt.errors import InvalidInputError
from specrt.jobs import openai_batch
from specrt.jobs.output import _lock, done_ids
from specrt.jobs.rows import Row, check_ids, input_size, read_rows
from specrt.openai_shapes import token_text
from specrt.openai_tools import ToolCalling
from specrt.runtime.batching import Request
from specrt.runtime.config import GenerationConfig
from specrt.runtime.generator import SpeculativeGenerator, row_rng
from specrt.runtime.results import GenerationResult, GenerationStats


class Choice(NamedTuple):
    """The key of choice ``index`` of a row that asks for several (an OpenAI line's ``n``)."""

    row: str | int
    index: int


@dataclass
class Summary:
    rows: int = 0  # in the input
    ok: int = 0
    failed: int = 0
    skipped: int = 0  # already in the output from an earlier run
    skipped_errors: int = 0  # of them, error records
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of them, copied from a row that held them (`prefixes`)
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
        self.prompt_tokens += stats["prompt_tokens"]
        self.cached_tokens += stats.get("cached_tokens", 0)
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
    tool_parser: str | None = None,
    chat_template: str | None = None,
) -> Summary:
    """Run every row of ``input_path`` not yet in ``output_path``, appending its result as it
    finishes (rows share model calls when the generator was loaded with ``max_batch`` > 1, so
    they finish out of input order). ``output_format``: "specrt" (our records), "openai"
    (OpenAI's batch output lines, ``model`` named in their bodies) or "auto" (openai when every
    row is an OpenAI batch-file line). ``input_name``: the input as errors name it (standard
    input, spooled to a file); ``tool_parser``: the format chat lines' ``tool_choice: "auto"``
    reads the model's calls in (`specrt.openai_tools`); ``chat_template``: chat lines render
    with it in place of the bundle's (a Jinja file, or the template itself)."""
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
        decode = token_text(generator.tokenizer)

        def write(record: dict, status: int = 200) -> None:
            line, key = record, str(record["id"])
            if output_format == "openai":
                extras = (echoes.get(key), toolings.get(key), *asked.get(key, (False, None)))
                chat, row_id = key in chats, record["id"]
                line = openai_batch.record(row_id, record, chat, model, status, decode, *extras)
            chats.discard(key)
            echoes.pop(key, None)
            toolings.pop(key, None)
            asked.pop(key, None)
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

        choices: dict[str, list[GenerationResult | None]] = {}  # rows of n > 1 in flight
        echoes: dict[str, openai_batch.Echo] = {}  # echoed rows in flight: their prompts
        toolings: dict[str, ToolCalling] = {}  # rows in flight whose answers may be tool calls
        asked: dict[str, tuple] = {}  # rows in flight asking vLLM's token id fields

        def requests() -> Iterator[Request]:
            """The rows to run, read as slots free up; the others are settled on the way. A row
            of ``n`` choices is ``n`` requests, choice i drawing from the stream (seed, i)."""
            for row in read_rows(input_path, input_name, size, tool_parser):
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
                if row.tools is not None:
                    toolings[str(row.id)] = row.tools
                request = make_request(generator, row, defaults, True, chat_template)
                if row.echo and not isinstance(request, dict):
                    text = row.prompt if isinstance(row.prompt, str) else decode(request.prompt)
                    echoes[str(row.id)] = openai_batch.Echo(text, request.prompt, row.scored_only)
                if (row.as_ids or row.token_ids) and not isinstance(request, dict):
                    asked[str(row.id)] = (row.as_ids, request.prompt if row.token_ids else None)
                if isinstance(request, dict):
                    write(request, 400)
                elif row.n == 1:
                    yield request
                else:  # written once every choice is done (a kill runs the row again)
                    choices[str(row.id)] = [None] * row.n
                    for i in range(row.n):
                        rng = row_rng(request.config, i)
                        yield replace(request, key=Choice(row.id, i), rng=rng)

        for key, result in generator.run(requests()):
            if isinstance(key, Choice):
                results = choices[str(key.row)]
                results[key.index] = result
                if all(results):
                    del choices[str(key.row)]
                    record = choices_record(key.row, results)
                    write(record, 500 if "error" in record else 200)
            else:
                write({"id": key, **result.to_dict()}, 500 if result.error else 200)
        if output_path.is_file():  # pipes and devices have nothing to sync
            os.fsync(out.fileno())
    summary.wall_time_s = time.perf_counter() - started
    decoders = (generator.target, generator.draft)
    summary.cache_bytes = sum(getattr(d, "cache_bytes", 0) for d in decoders)
    summary.cache_bytes_per_row = sum(getattr(d, "cache_bytes_per_row", 0) for d in decoders)
    if generator.suffix_cache is not None:
        summary.suffix_cache_tokens = generator.suffix_cache.tokens
        summary.suffix_cache_bytes = generator.suffix_cache.memory_bytes()
    return summary


def make_request(
    generator: SpeculativeGenerator,
    row: Row,
    defaults: GenerationConfig,
    several: bool = False,
    chat_template: str | None = None,
):
    """The row as a `Request` (its prompt tokenized and checked, its config and own random
    stream), or its error record; ``several``: the caller runs a row's ``n`` choices;
    ``chat_template``: a chat row renders with it in place of the bundle's."""
    if row.error is not None:
        return {"id": row.id, "error": {"message": row.error}}
    if row.n > 1 and not several:
        message = f"n={row.n}: only specrt batch answers several choices; send one row per choice"
        return {"id": row.id, "error": {"message": message}}
    if "logprobs" in row.options and not several:
        message = (
            "logprobs: a Ray Data row cannot ask for log-probabilities on its own (its "
            "results' columns are the predictor's): give SpecrtPredictor logprobs=N instead"
        )
        return {"id": row.id, "error": {"message": message}}
    try:
        config = replace(defaults, **row.options)
        if "seed" not in row.options and config.seed is not None:
            config = replace(config, seed=row_seed(config.seed, row.id))
        generator.check_config(config)
        tools = row.tools and row.tools.tools
        text = row.prompt
        if row.messages is not None:
            text = chat_prompt(generator, row.messages, tools, row.rendering, chat_template)
        [prompt] = generator.encode_prompts([text], config)
    except InvalidInputError as exc:
        return {"id": row.id, "error": {"message": str(exc)}}
    return Request(row.id, prompt, config, row_rng(config, 0))


def choices_record(row_id: str | int, results: list[GenerationResult]) -> dict:
    """The record of a row of several choices: each one's text, tokens and finish reason
    under ``choices``, the first's also where a record of one has them (readers of those go
    on working), the counters summed over them (`GenerationStats.total`); an error where
    any failed."""
    failed = next((r.error for r in results if r.error), None)
    if failed is not None:
        return {"id": row_id, "error": {"message": failed}}
    keys = ("text", "token_ids", "finish_reason", "logprobs", "prompt_logprobs")
    each = [{k: v for k, v in r.to_dict().items() if k in keys} for r in results]
    stats = GenerationStats.total([r.stats for r in results]).to_dict()
    return {"id": row_id, **each[0], "stats": stats, "choices": each}


def chat_prompt(
    generator: SpeculativeGenerator,
    messages: object,
    tools: list[dict] | None = None,
    rendering: Rendering | None = None,
    chat_template: str | None = None,
) -> list[int]:
    """A chat row's messages (and ``tools``) rendered by the bundle's chat template (or
    ``chat_template`` in its place) as ``rendering`` asks, as token ids (the template writes
    the special tokens itself, as `specrt serve` reads them)."""
    tokenizer = generator.tokenizer
    template = None
    if tokenizer is not None:
        template = bundle_chat_template(tokenizer.directory, chat_template)
    if template is None:
        raise InvalidInputError(
            'this bundle\'s tokenizer has no chat template: give a "prompt" instead of '
            '"messages", or a template with --chat-template'
        )
    try:
        text = template.prompt(messages, tools, rendering)
        return tokenizer.encode(text, add_special_tokens=False)
    except ChatTemplateError as exc:
        raise InvalidInputError(str(exc)) from exc


@functools.cache
def bundle_chat_template(directory: Path, given: str | None = None):
    """The bundle's chat template (or ``given`` in its place), read once per job (a broken one
    stops the job: every chat row would fail the same way)."""
    try:
        from specrt.chat import ChatTemplate

        return ChatTemplate.from_directory(directory, given)
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

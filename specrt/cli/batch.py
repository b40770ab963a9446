"""`specrt batch`: a JSONL file of rows into a JSONL file of results, resumable."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click

from specrt.cli.common import (
    _cache_plan,
    _chat_template,
    _count,
    _friendly_errors,
    _generation_config,
    _load,
    _proposer_line,
    _Terminated,
)
from specrt.cli.options import (
    CHAT_TEMPLATE_OPTION,
    KV_CACHE_OPTION,
    TOOL_PARSER_OPTION,
    generation_options,
    load_options,
    suffix_cache_options,
)
from specrt.errors import InvalidInputError
from specrt.runtime.batching import DEFAULT_BATCH_SIZE, MAX_BATCH


@click.command()
@click.option("--bundle", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@click.option(
    "--input",
    "input_path",
    required=True,
    type=click.Path(path_type=Path),
    help='JSONL: {"id", "prompt" (or chat "messages"), optional "max_new_tokens", "temperature", '
    '"top_k", "top_p", "min_p", "seed", "num_draft_tokens", "stop", "stop_token_ids", '
    '"proposer", "logprobs"}, or OpenAI batch-file '
    'lines ("-": stdin).',
)
@click.option(
    "--output",
    "output_path",
    required=True,
    type=click.Path(path_type=Path),
    help='JSONL results, one per row as it finishes; rerun to resume after a crash ("-": '
    "stdout, which cannot be resumed).",
)
@click.option(
    "--output-format",
    type=click.Choice(["auto", "specrt", "openai"]),
    default="auto",
    show_default=True,
    help="specrt: our records (id, text, token_ids, finish_reason, stats); openai: OpenAI's batch "
    "output lines (custom_id, response.body a completion); auto: openai when every input line is "
    "an OpenAI batch-file line.",
)
@click.option("--summary", type=click.Path(path_type=Path), help="Write the summary as JSON.")
@click.option("--progress/--no-progress", default=None, help="A progress bar [on a terminal].")
@click.option(
    "--batch-size",
    type=click.IntRange(1, MAX_BATCH),
    default=DEFAULT_BATCH_SIZE,
    show_default=True,
    help="Rows that share each model call (the onnxruntime and cuda engines and the portable "
    "graph; the TensorRT engines, Gemma 2's cuda engine and Gemma 2 and 3's portable graphs run "
    "one row).",
)
@KV_CACHE_OPTION
@TOOL_PARSER_OPTION
@CHAT_TEMPLATE_OPTION
@generation_options
@suffix_cache_options(False, "Rows' text then informs other rows' proposals.")
@load_options
@_friendly_errors
def batch(
    bundle,
    input_path,
    output_path,
    output_format,
    summary,
    progress,
    batch_size,
    kv_cache_memory,
    tool_call_parser,
    chat_template,
    suffix_cache,
    suffix_cache_tokens,
    threads,
    engine,
    max_length,
    skip_checksums,
    use_corpus,
    **params,
) -> None:
    """Run a JSONL file of prompts into a JSONL file of results (resumable, row errors kept).

    Up to --batch-size rows share each model call; the draft length adapts to the load (K = 0
    where drafting does not pay) unless --draft-schedule fixed is given."""
    from specrt.jobs.batch import preflight, progress_bar, run_batch
    from specrt.jobs.output import output_paths
    from specrt.jobs.rows import input_name, spooled

    try:  # found now, not after the whole job
        output_path, summary = output_paths(input_path, output_path, summary)
    except InvalidInputError as exc:
        raise click.UsageError(str(exc)) from exc
    defaults = _generation_config(params)
    if chat_template is not None:  # a template that does not compile: now, not per row
        _chat_template(bundle, chat_template)
    suffix_tokens = suffix_cache_tokens if suffix_cache else 0
    with spooled(input_path) as rows:  # stdin or a pipe: read twice (ids first), so spooled
        name = input_name(input_path, rows)
        preflight(rows, output_path, output_format, name)  # not after minutes of loading
        plan = _cache_plan(bundle, kv_cache_memory, batch_size, max_length, engine)
        click.echo(f"specrt batch: {plan.describe()}", err=True)
        generator = _load(
            bundle,
            threads,
            engine,
            plan.max_length,
            skip_checksums,
            plan.max_batch,
            suffix_tokens,
            use_corpus,
        )
        if generator.max_batch < plan.max_batch:
            click.echo(
                f"note: the {engine} graphs run one row per call (the TensorRT engines, Gemma "
                "2's cuda engine, Gemma 2 and 3's portable graphs, and onnxruntime or cuda "
                "engines built by earlier versions of specrt: rebuild those with `specrt build "
                f"--bundle {shlex.quote(str(bundle))} [--device cuda]`); --batch-size "
                f"{plan.max_batch} has no effect",
                err=True,
            )
        try:  # (SIGTERM arrives as _Terminated: `_friendly_errors`)
            result = run_batch(
                generator,
                rows,
                output_path,
                defaults,
                progress_bar(progress),
                output_format,
                model=Path(bundle).resolve().name,  # as `specrt serve` names it
                input_name=name,
                tool_parser=tool_call_parser,
                chat_template=chat_template,
            )
        except (KeyboardInterrupt, _Terminated) as exc:
            click.echo(
                f"\ninterrupted: the rows finished so far are in {output_path}; run the same "
                "command again to go on from there",
                err=True,
            )
            sys.exit(130 if isinstance(exc, KeyboardInterrupt) else 143)
    report = result.to_dict()
    if summary is not None:
        summary.parent.mkdir(parents=True, exist_ok=True)
        summary.write_text(json.dumps(report, indent=2) + "\n")
    click.echo(
        f"{_count(result.rows, 'row')}: {result.ok} ok, {result.failed} failed, "
        f"{result.skipped} already done ({result.skipped_errors} of them errors); "
        f"{result.new_tokens} tokens at {result.tokens_per_second:.1f} tokens/s, acceptance "
        f"{result.acceptance_rate:.2f}; {_count(result.batch_size, 'row')} per call, KV cache "
        f"{result.cache_bytes / 2**20:.1f} MiB "
        f"({result.cache_bytes_per_row / 2**20:.1f} MiB per row at most)"
        + _proposer_line(result.proposers)
        + (
            f"; {result.cached_tokens} of {result.prompt_tokens} prompt tokens copied from "
            "a beginning another row had read"
            if result.cached_tokens
            else ""
        )
        + ("; written as OpenAI batch output" if result.output_format == "openai" else "")
        + (
            f"; suffix cache {result.suffix_cache_tokens} tokens, "
            f"{result.suffix_cache_bytes / 2**20:.1f} MiB"
            if suffix_cache
            else ""
        ),
        err=True,
    )
    if not result.rows:
        click.echo(f"note: {input_path} holds no rows: nothing was run", err=True)
    if result.skipped_errors:
        click.echo(
            f"rows whose records in {output_path} are errors are not run again: delete those "
            "lines to run them again",
            err=True,
        )
    if result.other_record_count:  # rows are matched by id alone
        shown = ", ".join(repr(i) for i in result.other_records)
        more = ", ..." if result.other_record_count > len(result.other_records) else ""
        click.echo(
            f"note: {output_path} also holds {result.other_record_count} record(s) of ids not "
            f"in {input_path} ({shown}{more}): a line since mended, or rows removed; they are "
            "left as they are",
            err=True,
        )
    if not result.all_ok:
        sys.exit(1)

"""`specrt bench`: every contender side by side on the same prompts."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specrt.bench.defaults import BENCH_MAX_DRAFT_TOKENS, BENCH_NEW_TOKENS, GENAI_MODELS
from specrt.cli.common import _chat_prompts, _friendly_errors, _prompts
from specrt.cli.options import ENGINE_OPTION, THREADS_TYPE, _threads
from specrt.errors import InvalidInputError
from specrt.runtime.config import MAX_DRAFT_TOKENS


@click.command()
@click.option("--bundle", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable).")
@click.option(
    "--prompt-file",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Prompts, one per line (repeatable: each file in turn); a .jsonl file holds "
    '{"prompt": ...} objects or JSON strings '
    '(prompts of several lines); "-": stdin.',
)
@click.option("--num-prompts", type=click.IntRange(min=1), default=None, help="Use the first N.")
@click.option(
    "--chat",
    is_flag=True,
    help='Each prompt is a user\'s message (a .jsonl line may hold {"messages": [...]}), '
    "rendered with the bundle's chat template, as `specrt generate --chat` does.",
)
@click.option(
    "--max-new-tokens", type=click.IntRange(min=1), default=BENCH_NEW_TOKENS, show_default=True
)
@click.option(
    "--max-draft-tokens",
    type=click.IntRange(1, MAX_DRAFT_TOKENS),
    default=BENCH_MAX_DRAFT_TOKENS,
    show_default=True,
)
@click.option(
    "--threads", type=THREADS_TYPE, default=None, callback=_threads, help="Threads for everyone."
)
@ENGINE_OPTION
@click.option("--no-transformers", is_flag=True, help="Skip the PyTorch contenders.")
@click.option(
    "--genai-python",
    type=click.Path(path_type=Path),
    help="Python of the onnxruntime-genai environment (bash bench/genai_env.sh makes it).",
)
@click.option(
    "--genai-models",
    type=click.Path(path_type=Path),
    default=GENAI_MODELS,
    show_default=True,
    help="The pair as built by onnxruntime-genai's builder.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--plot", type=click.Path(path_type=Path), help="Write speedup/acceptance plot.")
@_friendly_errors
def bench(
    bundle,
    prompts,
    prompt_file,
    num_prompts,
    chat,
    max_new_tokens,
    max_draft_tokens,
    threads,
    engine,
    no_transformers,
    genai_python,
    genai_models,
    as_json,
    plot,
) -> None:
    """Benchmark specrt (target only, K = 1..N, adaptive, heuristic) against transformers and
    onnxruntime-genai, interleaved."""
    from specrt.bench.report import check_plot_path, table
    from specrt.bench.report import plot as draw
    from specrt.bench.runner import run_benchmark
    from specrt.jobs.output import check_writable

    texts = _prompts(prompts, prompt_file, chat)[:num_prompts]
    if chat:
        if genai_python:
            raise click.UsageError(
                "--chat: the onnxruntime-genai contender reads plain prompts; leave out "
                "--genai-python or --chat"
            )
        texts = _chat_prompts(bundle, texts)
    if plot:  # found now, not after the whole benchmark
        try:
            check_writable(Path(plot), "--plot")
        except InvalidInputError as exc:
            raise click.UsageError(str(exc)) from exc
        check_plot_path(Path(plot))
    report = run_benchmark(
        bundle,
        texts,
        max_new_tokens=max_new_tokens,
        threads=threads,
        ks=tuple(range(1, max_draft_tokens + 1)),
        with_transformers=not no_transformers,
        engine=engine,
        chat=chat,
        genai=(genai_python, genai_models) if genai_python else None,
        log=lambda message: click.echo(message, err=True),
    )
    click.echo(json.dumps(report) if as_json else table(report))
    if plot:
        draw(report, plot)

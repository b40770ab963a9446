"""`specrt generate`: prompts in, text and its statistics out."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specrt.cli.common import (
    _chat_prompts,
    _friendly_errors,
    _generation_config,
    _load,
    _print_human,
    _prompts,
)
from specrt.cli.options import CHAT_TEMPLATE_OPTION, generation_options, load_options


@click.command()
@click.option("--bundle", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable).")
@click.option(
    "--prompt-file",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Prompts, one per line (repeatable: each file in turn); a .jsonl file holds "
    '{"prompt": ...} objects or JSON strings '
    '(prompts of several lines), with --chat also {"messages": [...]} conversations; "-": stdin.',
)
@click.option(
    "--chat",
    is_flag=True,
    help="Render each prompt as a user's message (and each messages line as a conversation) "
    "with the bundle's chat template, as `specrt serve`'s chat route does.",
)
@CHAT_TEMPLATE_OPTION
@generation_options
@load_options
@click.option(
    "--compare", is_flag=True, help="Also run the target alone and report the measured speedup."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt.")
@_friendly_errors
def generate(
    bundle,
    prompts,
    prompt_file,
    chat,
    chat_template,
    as_json,
    threads,
    engine,
    max_length,
    skip_checksums,
    use_corpus,
    compare,
    **params,
) -> None:
    """Generate from a bundle with speculative decoding."""
    from specrt.runtime.comparison import compare_with_target_only

    if chat_template is not None and not chat:
        raise click.UsageError("--chat-template renders chats: give --chat with it")
    texts = _prompts(prompts, prompt_file, chat)
    if chat:
        texts = _chat_prompts(bundle, texts, chat_template)
    config = _generation_config(params, notes=True)
    generator = _load(bundle, threads, engine, max_length, skip_checksums, use_corpus=use_corpus)
    inputs = texts
    if chat:  # the template writes its special tokens out: none added (as the server does)
        inputs = [generator.tokenizer.encode(text, add_special_tokens=False) for text in texts]
    if compare:
        outputs = compare_with_target_only(generator, inputs, config)
    else:
        generator.encode_prompts(inputs)  # every prompt is checked before any work starts
        outputs = ((result, None) for result in generator.stream(inputs, config))
    for text, (result, comparison) in zip(texts, outputs):
        record = result.to_dict()
        if comparison is not None:
            record["comparison"] = comparison.to_dict()
        if as_json:
            click.echo(json.dumps(record))
        else:
            _print_human(text, record)
        sys.stdout.flush()

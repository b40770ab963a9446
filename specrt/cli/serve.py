"""`specrt serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

from pathlib import Path

import click

from specrt.cli.common import (
    DEFAULTS,
    _cache_plan,
    _chat_template,
    _friendly_errors,
    _generation_config,
    _load,
)
from specrt.cli.options import (
    CHAT_TEMPLATE_OPTION,
    KV_CACHE_OPTION,
    PROPOSER_OPTION,
    TOOL_PARSER_OPTION,
    load_options,
    suffix_cache_options,
)
from specrt.runtime.batching import DEFAULT_SERVE_BATCH_SIZE, MAX_BATCH
from specrt.runtime.config import DRAFT_SCHEDULES, MAX_DRAFT_TOKENS


@click.command()
@click.option("--bundle", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--model-name",
    "--served-model-name",  # vLLM's name
    "model_name",
    default=None,
    help="The model id clients ask for [bundle name].",
)
@click.option(
    "--api-key",
    envvar="SPECRT_API_KEY",
    show_envvar=True,
    default=None,
    help="Clients must send it as a bearer token on /v1 (/health and /metrics stay open).",
)
@click.option(
    "--batch-size",
    "--max-num-seqs",  # vLLM's name
    "batch_size",
    type=click.IntRange(1, MAX_BATCH),
    default=DEFAULT_SERVE_BATCH_SIZE,
    show_default=True,
    help="Requests that share each model call (more wait for a slot).",
)
@click.option(
    "--max-waiting",
    type=click.IntRange(min=0),
    default=64,
    show_default=True,
    help="Requests that may wait for a slot (0: none, a request is taken only while a slot is "
    "free); beyond them clients get 429.",
)
@click.option(
    "--scheduling-policy",
    type=click.Choice(["fcfs", "priority"]),
    default="fcfs",
    show_default=True,
    help="Which waiting request takes a free slot: the first to come (fcfs), or the lowest "
    "`priority` a body gives, then the first (priority; vLLM's). Under fcfs a body's priority "
    "other than 0 is a 400.",
)
@click.option(
    "--num-draft-tokens",
    type=click.IntRange(0, MAX_DRAFT_TOKENS),
    default=DEFAULTS["num_draft_tokens"],
    show_default=True,
    help="K at most, the draft model's (and of matches, where requests share a call); 0 = "
    "target only.",
)
@click.option(
    "--draft-schedule",
    type=click.Choice(DRAFT_SCHEDULES),
    default=DEFAULTS["draft_schedule"],
    show_default=True,
    help="adaptive: K chosen for the load each round.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    help="The log lines written to stdout (info: the start, and a line as each request comes "
    "and ends); uvicorn's too.",
)
@TOOL_PARSER_OPTION
@click.option(
    "--enable-auto-tool-choice",
    is_flag=True,
    help='vLLM\'s flag for tool_choice "auto": taken with --tool-call-parser, which alone '
    "enables it here.",
)
@CHAT_TEMPLATE_OPTION
@PROPOSER_OPTION
@suffix_cache_options(
    False, "Off by default: a request's text may then appear in another's proposals."
)
@KV_CACHE_OPTION
@load_options
@_friendly_errors
def serve(
    bundle,
    host,
    port,
    model_name,
    api_key,
    batch_size,
    max_waiting,
    scheduling_policy,
    num_draft_tokens,
    draft_schedule,
    log_level,
    tool_call_parser,
    enable_auto_tool_choice,
    chat_template,
    proposer,
    suffix_cache,
    suffix_cache_tokens,
    kv_cache_memory,
    threads,
    engine,
    max_length,
    skip_checksums,
    use_corpus,
) -> None:
    """Serve a bundle over an OpenAI-compatible HTTP API (needs the serve extra)."""
    try:
        from specrt.serve.server import configure_logging, listen
        from specrt.serve.server import serve as run_server
    except ImportError as exc:
        raise click.ClickException(
            f"specrt serve needs the serve extra ({exc.name} is missing): "
            "pip install 'specrt[serve]'"
        ) from exc
    if api_key == "":  # an empty key would let every client in
        raise click.UsageError(
            "--api-key (or SPECRT_API_KEY) is empty: give a key, or leave it out to serve "
            "without one"
        )
    if enable_auto_tool_choice and tool_call_parser is None:  # as vLLM refuses it
        raise click.UsageError(
            "--enable-auto-tool-choice needs --tool-call-parser: the format of the model's "
            "own tool calls (hermes, llama3_json, pythonic or mistral)"
        )
    if chat_template is not None:  # a template that does not compile: now, not after the load
        _chat_template(bundle, chat_template)
    sock = listen(host, port)  # a taken port fails now, not after the load
    log = configure_logging(log_level)  # stdout, as vLLM's; errors that end it: stderr
    suffix_tokens = suffix_cache_tokens if suffix_cache else 0
    plan = _cache_plan(bundle, kv_cache_memory, batch_size, max_length, engine)
    # taken at start: no request waits for an allocation
    log.info("specrt serve: %s, taken at start", plan.describe("requests"))
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
    defaults = _generation_config(
        dict(num_draft_tokens=num_draft_tokens, draft_schedule=draft_schedule, proposer=proposer)
    )
    name = model_name or Path(bundle).resolve().name
    run_server(
        generator, name, defaults, host=host, port=port, max_waiting=max_waiting, sock=sock,
        scheduling_policy=scheduling_policy, api_key=api_key, log_level=log_level,
        tool_parser=tool_call_parser, chat_template=chat_template,
    )  # fmt: skip

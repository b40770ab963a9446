"""What every command shares: the defaults, one clear line for an error (never a
traceback), the generation config from the options, loading a bundle, file checks, printing."""

from __future__ import annotations

import functools
import os
import signal
import sys
from dataclasses import fields
from pathlib import Path

import click
from click.core import ParameterSource

from specrt.errors import (
    InvalidInputError,
    SpecrtError,
    describe_os_error,
)
from specrt.prompts import collect_prompts
from specrt.runtime.config import GenerationConfig

# The commands' defaults: the library's own (`GenerationConfig`), one set for the library, the
# CLI and the server.
DEFAULTS = {f.name: f.default for f in fields(GenerationConfig)}
EXPORT_EXTRA = "pip install torch==2.13.0 && pip install 'specrt[export]'"
# What `export` and `build` import (lazily, deep in the pipeline): import names, not packages.
EXPORT_MODULES = ("torch", "transformers", "optimum", "onnx", "onnxslim", "onnx_ir")


class _Terminated(BaseException):
    """SIGTERM (what systemd, k8s and timeout send): stop as Ctrl-C does, cleaning up on the
    way (a build's staging directory, a batch job's copy of stdin). A BaseException, as
    KeyboardInterrupt is: no `except Exception` may swallow it."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def _friendly_errors(command):
    """Turn specrt's own errors and the machine's (disk full, read-only, permissions) into a
    one-line message and exit status 1; anything else is a bug and keeps its traceback. Where
    the program reading the output stops (`| head`), stop quietly with status 1, as Unix
    tools do. Ctrl-C and SIGTERM stop with one line and 130 / 143, as a shell reports them."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        previous = signal.getsignal(signal.SIGTERM)
        if previous == signal.SIG_DFL:  # `serve` hands SIGTERM to uvicorn once it runs
            signal.signal(signal.SIGTERM, _terminate)
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt:
            click.echo("\ninterrupted (Ctrl-C)", err=True)
            sys.exit(130)
        except _Terminated:
            click.echo("\nterminated (SIGTERM)", err=True)
            sys.exit(143)
        except BrokenPipeError:
            # Python flushes stdout again at exit, which would fail and print; send it nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except SpecrtError as exc:
            raise click.ClickException(str(exc)) from exc
        except OSError as exc:
            raise click.ClickException(describe_os_error(exc)) from exc
        finally:
            if previous == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, previous)

    return wrapper


def _cache_plan(bundle, kv_cache_memory: str, batch_size: int, max_length: int, engine: str):
    """Rows and positions of the KV cache for the budget (`specrt.runtime.memory`)."""
    from specrt.bundle import read_manifest
    from specrt.runtime.memory import parse_size, plan_cache

    try:
        budget = parse_size(kv_cache_memory)
    except InvalidInputError as exc:
        raise click.BadParameter(str(exc), param_hint="--kv-cache-memory") from exc
    return plan_cache(read_manifest(bundle), budget, batch_size, max_length, engine)


def _flags(names: list[str]) -> str:
    """The options' flags, with the verb that follows them ("--seed changes")."""
    flags = ", ".join("--" + name.replace("_", "-") for name in names)
    return flags + (" change" if len(names) > 1 else " changes")


def _as_option(ctx: click.Context, exc: Exception) -> str:
    """``exc``'s message in the command's words: ``--num-draft-tokens -1 ...`` for
    ``num_draft_tokens=-1 ...`` where the name before "=" (an `InvalidInputError`'s field, or
    the message's own first word) is an option given on the command line."""
    message = str(exc)
    field = getattr(exc, "field", None) or message.partition("=")[0]
    option = next((p for p in ctx.command.params if p.name == field), None)
    given = option is not None and ctx.get_parameter_source(field) == ParameterSource.COMMANDLINE
    if not given or not message.startswith(f"{field}="):  # e.g. a recipe's setting
        return message
    flag = max(option.opts, key=len)
    return f"{flag} {message[len(field) + 1 :]}"


def _generation_config(params: dict, notes: bool = False) -> GenerationConfig:
    """The generation options as a config; a bad value is a usage error (status 2), as
    click's own range checks are, and so are options that contradict each other. ``notes``:
    say which options given change nothing in this run."""
    ctx = click.get_current_context()
    schedule = params.get("draft_schedule")
    chosen = ctx.get_parameter_source("draft_schedule") == ParameterSource.COMMANDLINE
    if params.get("adaptive_draft") and chosen and schedule != "adaptive":
        raise click.UsageError(
            f"--adaptive-draft and --draft-schedule {schedule} contradict each other: give one"
        )
    if params.pop("adaptive_draft", False):  # the deprecated flag: the same schedule
        params["draft_schedule"] = "adaptive"
    structured = _structured(params)
    if structured:
        params["structured_output"] = structured
    try:
        config = GenerationConfig(**params)
    except InvalidInputError as exc:
        raise click.UsageError(_as_option(ctx, exc)) from exc
    if notes:  # options the run cannot use (a batch row or a request may set what they need)
        given = {n for n in params if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE}
        sampling = [n for n in ("top_k", "top_p", "min_p", "seed") if n in given]
        if sampling and config.greedy:
            click.echo(f"note: {_flags(sampling)} nothing at --temperature 0 (greedy)", err=True)
        lookup = [n for n in ("prompt_lookup_min", "prompt_lookup_max") if n in given]
        if lookup and (config.proposer == "model" or not config.num_draft_tokens):
            click.echo(
                f"note: {_flags(lookup)} nothing without prompt lookup (--proposer "
                "lookup or hybrid, and --num-draft-tokens above 0)",
                err=True,
            )
    return config


def _structured(params: dict) -> dict:
    """The structured-output options (taken out of ``params``) as `StructuredOutput` fields;
    a schema or grammar given as a file is read."""
    given = {
        "json": params.pop("json_schema", None),
        "json_object": params.pop("json_object", False),
        "regex": params.pop("regex", None),
        "choice": params.pop("choice", ()),
        "grammar": params.pop("grammar", None),
    }
    schema = given["json"]
    if schema and not schema.lstrip().startswith("{") and not Path(schema).is_file():
        message = f"--json-schema {schema}: no such file (give a schema's file or its JSON text)"
        raise click.UsageError(message)
    for name, flag in (("json", "--json-schema"), ("grammar", "--grammar")):
        value = given[name]
        if value and not value.lstrip().startswith("{") and Path(value).is_file():
            try:
                given[name] = Path(value).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise click.UsageError(f"{flag} {value}: cannot read it ({exc})") from None
    return {name: value for name, value in given.items() if value}


def _prompts(
    prompts: tuple[str, ...], prompt_file: tuple[Path, ...], chat: bool | None = False
) -> list:
    try:
        return collect_prompts(prompts, prompt_file, chat)
    except InvalidInputError as exc:
        raise click.UsageError(str(exc)) from exc


def _chat_template(bundle: Path, given: str | None = None):
    """The bundle's chat template, or ``given`` in its place (``--chat-template``: a file, or
    the template itself); None: the bundle has none."""
    try:
        from specrt.chat import ChatTemplate
    except ImportError as exc:
        raise click.ClickException(
            f"chat templates need jinja2 (the serve extra): pip install 'specrt[serve]' ({exc})"
        ) from exc
    try:
        return ChatTemplate.from_directory(Path(bundle) / "tokenizer", given)
    except InvalidInputError as exc:
        raise click.UsageError(str(exc)) from exc


def _chat_prompts(bundle: Path, items: list, given: str | None = None) -> list[str]:
    """Each item (a user's message, or a conversation of OpenAI messages) rendered with the
    bundle's chat template (or ``given``: `_chat_template`), as `specrt serve` renders a chat
    request."""
    from specrt.chat import ChatTemplateError

    template = _chat_template(bundle, given)
    if template is None:
        raise click.UsageError(
            f"the bundle {bundle} has no chat template (tokenizer/chat_template.jinja, or "
            "chat_template in tokenizer/tokenizer_config.json): export it from a chat model, "
            "give one with --chat-template, or leave out --chat"
        )
    rendered = []
    for number, item in enumerate(items, 1):
        messages = [{"role": "user", "content": item}] if isinstance(item, str) else item
        try:
            rendered.append(template.prompt(messages))
        except ChatTemplateError as exc:
            raise click.UsageError(f"prompt {number}: {exc}") from exc
    return rendered


def _load(
    bundle,
    threads,
    engine,
    max_length,
    skip_checksums,
    max_batch=1,
    suffix_tokens=0,
    use_corpus=True,
):
    """``suffix_tokens``: keep a suffix cache of that many tokens (0: none); ``use_corpus``:
    draft from the bundle's corpus where it has one."""
    from specrt.runtime import SpeculativeGenerator
    from specrt.runtime.lookup import SuffixCache

    return SpeculativeGenerator.from_bundle(
        bundle,
        suffix_cache=SuffixCache(suffix_tokens) if suffix_tokens else None,
        threads=threads,
        engine=engine,
        max_length=max_length,
        check_files=not skip_checksums,
        max_batch=max_batch,
        corpus=use_corpus,
    )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _proposer_line(proposers: dict[str, dict]) -> str:
    """ "; proposed/accepted by proposer" where more than the model proposed."""
    if set(proposers) <= {"model"}:
        return ""
    parts = [
        f"{source} {entry['accepted']}/{entry['proposed']}" for source, entry in proposers.items()
    ]
    return "; accepted/proposed by " + ", ".join(parts)


def _print_human(prompt: str, record: dict) -> None:
    stats = record["stats"]
    click.echo(click.style(prompt, bold=True) + record["text"])
    line = (
        f"[{stats['new_tokens']} tokens, finish={record['finish_reason']}, "
        f"{stats['tokens_per_second']:.1f} tokens/s, "
        + (f"acceptance {stats['acceptance_rate']:.2f}, " if stats["drafted_tokens"] else "")
        + f"{stats['tokens_per_round']:.2f} tokens/round"
        + _proposer_line(stats.get("proposers", {}))
    )
    if "comparison" in record:
        comparison = record["comparison"]
        line += (
            f", speedup {comparison['speedup']:.2f}x vs target alone "
            f"({comparison['target_only_tokens_per_second']:.1f} tokens/s"
            f"{', identical output' if comparison['identical_output'] else ''})"
        )
    click.echo(click.style(line + "]", dim=True), err=True)

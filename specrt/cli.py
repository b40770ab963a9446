"""specrt's command line: export a pair into a bundle, build recipes, generate from a bundle."""

from __future__ import annotations

import errno
import functools
import importlib.util
import json
import os
import shlex
import signal
import sys
from dataclasses import fields
from pathlib import Path

import click
from click.core import ParameterSource

from specrt.backends import DEFAULT_MAX_LENGTH, ENGINE_CHOICES
from specrt.bench.defaults import BENCH_MAX_DRAFT_TOKENS, BENCH_NEW_TOKENS, GENAI_MODELS
from specrt.errors import (
    ExportError,
    InvalidInputError,
    SpecrtError,
    describe_os_error,
    unwritable_reason,
)
from specrt.export.options import (
    CUDA_ATTENTIONS,
    DEFAULT_ATOL,
    DEFAULT_DRAFT_PRECISION,
    DEVICES,
    PRECISIONS,
)
from specrt.prompts import collect_prompts
from specrt.runtime.batching import DEFAULT_BATCH_SIZE, DEFAULT_SERVE_BATCH_SIZE, MAX_BATCH
from specrt.runtime.config import DRAFT_SCHEDULES, MAX_DRAFT_TOKENS, PROPOSERS, GenerationConfig
from specrt.runtime.lookup import DEFAULT_SUFFIX_TOKENS

# The commands' defaults: the library's, except who drafts and how much. The hybrid proposer
# with the adaptive schedule measured fastest on held-out text (README, "Proposers").
DEFAULTS = {
    **{f.name: f.default for f in fields(GenerationConfig)},
    "proposer": "hybrid",
    "draft_schedule": "adaptive",
}
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


ENGINE_OPTION = click.option(
    "--engine",
    type=click.Choice(ENGINE_CHOICES),
    default=ENGINE_CHOICES[0],
    show_default=True,
    help="Which graphs run: each model's onnxruntime engine where the bundle has one (auto), or "
    "the portable ones.",
)


DEVICE_OPTION = click.option(
    "--device",
    "devices",
    type=click.Choice(DEVICES),
    multiple=True,
    help="What to build engines for (repeatable) [cpu]: cuda builds the float16 engines the CUDA "
    "provider runs (they are checked here, on the CPU).",
)
CUDA_ATTENTION_OPTION = click.option(
    "--cuda-attention",
    type=click.Choice(CUDA_ATTENTIONS),
    default=None,
    help="The cuda engine's graph [batched]: batched runs many rows per call; group_query, one "
    "row per call on GroupQueryAttention's kernels (what soft-capped models always get).",
)


def draft_precision_option(default: str | None):
    return click.option(
        "--draft-precision",
        type=click.Choice(PRECISIONS),
        default=default,
        help=f"Weights of the draft's onnxruntime engine [{DEFAULT_DRAFT_PRECISION}]: cheaper "
        "drafting, same output.",
    )


def _stack(*decorators):
    """One decorator applying several click options, in the order written."""

    def apply(command):
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return apply


PROPOSER_OPTION = click.option(
    "--proposer",
    type=click.Choice(PROPOSERS),
    default=DEFAULTS["proposer"],
    show_default=True,
    help="Who drafts: the draft model, prompt lookup (matches in the prompt and output), or "
    "the hybrid (per round, whichever is expected to be faster). All are lossless.",
)


def suffix_cache_options(default: bool, note: str):
    return _stack(
        click.option(
            "--suffix-cache/--no-suffix-cache",
            default=default,
            show_default=True,
            help="Also propose continuations learned from earlier rows' prompts and outputs "
            f"(lookup and hybrid proposers). {note}",
        ),
        click.option(
            "--suffix-cache-tokens",
            type=click.IntRange(min=1),
            default=DEFAULT_SUFFIX_TOKENS,
            show_default=True,
            help="Tokens the suffix cache keeps (oldest rows forgotten first).",
        ),
    )


generation_options = _stack(
    click.option(
        "--max-new-tokens", type=int, default=DEFAULTS["max_new_tokens"], show_default=True
    ),
    click.option(
        "--num-draft-tokens",
        type=int,
        default=DEFAULTS["num_draft_tokens"],
        show_default=True,
        help="K, the draft model's tokens a round (prompt lookup's too; in the one-row loop "
        "the hybrid's matches may run to 24); 0 = target only.",
    ),
    click.option(
        "--temperature",
        type=float,
        default=DEFAULTS["temperature"],
        show_default=True,
        help="0 = greedy.",
    ),
    click.option(
        "--top-k", type=int, default=DEFAULTS["top_k"], show_default=True, help="0 = off."
    ),
    click.option(
        "--top-p", type=float, default=DEFAULTS["top_p"], show_default=True, help="1 = off."
    ),
    click.option(
        "--seed",
        type=int,
        default=None,
        help="Seed for sampling: each row draws from its own stream, (seed, i) for generate's "
        "row i, (seed, id) for a batch row; its tokens are those of --num-draft-tokens 0 "
        "under the same seed.",
    ),
    click.option("--ignore-eos", is_flag=True, help="Do not stop at the end-of-sequence token."),
    click.option(
        "--stop",
        multiple=True,
        help="Stop where the new text first contains this string (repeatable; not output).",
    ),
    click.option(
        "--adaptive-draft",
        is_flag=True,
        help="Deprecated: the same as --draft-schedule adaptive (the default).",
    ),
    click.option(
        "--draft-schedule",
        type=click.Choice(DRAFT_SCHEDULES),
        default=DEFAULTS["draft_schedule"],
        show_default=True,
        help="How many tokens each round drafts (adaptive = --adaptive-draft).",
    ),
    PROPOSER_OPTION,
    click.option(
        "--prompt-lookup-min",
        type=int,
        default=DEFAULTS["prompt_lookup_min"],
        show_default=True,
        help="Shortest n-gram prompt lookup matches.",
    ),
    click.option(
        "--prompt-lookup-max",
        type=int,
        default=DEFAULTS["prompt_lookup_max"],
        show_default=True,
        help="Longest n-gram prompt lookup matches (the longest match wins).",
    ),
)


def _threads(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    """At most a few per CPU: onnxruntime starts every one (100000 took minutes, then hung)."""
    cpus = os.cpu_count() or 1
    if value is not None and value > MAX_THREADS_PER_CPU * cpus:
        raise click.BadParameter(
            f"{value} is far more than this machine's {cpus} CPUs can run: give at most "
            f"{MAX_THREADS_PER_CPU * cpus} ({cpus}, one a CPU, is usually fastest)"
        )
    return value


MAX_THREADS_PER_CPU = 4
THREADS_TYPE = click.IntRange(min=1)

load_options = _stack(
    click.option(
        "--threads",
        type=THREADS_TYPE,
        default=None,
        callback=_threads,
        help="onnxruntime intra-op threads.",
    ),
    ENGINE_OPTION,
    click.option(
        "--max-length",
        type=click.IntRange(min=2),
        default=DEFAULT_MAX_LENGTH,
        show_default=True,
        help="Longest prompt + output a row's KV cache holds (capped at the model's max "
        "positions); caches grow with the longest row up to it.",
    ),
    click.option(
        "--skip-checksums",
        is_flag=True,
        help="Trust the bundle's files without checking their sha256 (checked files are "
        "remembered, so only a first load of a bundle pays for it).",
    ),
)


KV_CACHE_OPTION = click.option(
    "--kv-cache-memory",
    default="auto",
    show_default=True,
    help="Memory for the KV cache (e.g. 4GiB): rows get --max-length positions each and are as "
    "many as fit, at most --batch-size; auto: half the memory available at start on the CPU, "
    "--batch-size x --max-length on a GPU.",
)


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
    try:
        config = GenerationConfig(**params)
    except InvalidInputError as exc:
        raise click.UsageError(str(exc)) from exc
    if notes:  # options the run cannot use (a batch row or a request may set what they need)
        given = {n for n in params if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE}
        sampling = [n for n in ("top_k", "top_p", "seed") if n in given]
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


def _prompts(prompts: tuple[str, ...], prompt_file: Path | None, chat: bool = False) -> list:
    try:
        return collect_prompts(prompts, prompt_file, chat)
    except InvalidInputError as exc:
        raise click.UsageError(str(exc)) from exc


def _chat_prompts(bundle: Path, items: list) -> list[str]:
    """Each item (a user's message, or a conversation of OpenAI messages) rendered with the
    bundle's chat template, as `specrt serve` renders a chat request."""
    try:
        from specrt.chat import ChatTemplate, ChatTemplateError
    except ImportError as exc:
        raise click.ClickException(
            f"--chat needs jinja2 (the serve extra): pip install 'specrt[serve]' ({exc})"
        ) from exc
    template = ChatTemplate.from_directory(Path(bundle) / "tokenizer")
    if template is None:
        raise click.UsageError(
            f"the bundle {bundle} has no chat template (tokenizer/chat_template.jinja, or "
            "chat_template in tokenizer/tokenizer_config.json): export it from a chat model, or "
            "leave out --chat"
        )
    rendered = []
    for number, item in enumerate(items, 1):
        messages = [{"role": "user", "content": item}] if isinstance(item, str) else item
        try:
            rendered.append(template.prompt(messages))
        except ChatTemplateError as exc:
            raise click.UsageError(f"prompt {number}: {exc}") from exc
    return rendered


@click.group()
@click.version_option(package_name="specrt")
def main() -> None:
    """Lossless speculative decoding on ONNX Runtime."""


# ------------------------------------------------------------------------------------------------
@main.command()
@click.option("--target", type=click.Path(path_type=Path), help="HF checkpoint dir of the target.")
@click.option("--draft", type=click.Path(path_type=Path), help="HF checkpoint dir of the draft.")
@click.option("--out", type=click.Path(path_type=Path), help="Bundle directory to write.")
@click.option(
    "--recipe",
    type=click.Path(path_type=Path),
    help="Recipe JSON (engines/NAME.json) naming target and draft; --out: engines/NAME.",
)
@click.option(
    "--atol", type=float, default=None, help=f"Max |logit diff| vs PyTorch [{DEFAULT_ATOL}]."
)
@click.option("--opset", type=int, default=None, help="ONNX opset (default: optimum's).")
@click.option("--slim", is_flag=True, help="Simplify the graphs with onnxslim (standard ops).")
@click.option(
    "--ort-engine/--no-ort-engine",
    default=None,
    help="Also build the onnxruntime engine (fused graph, in-place KV cache) [on].",
)
@draft_precision_option(None)
@DEVICE_OPTION
@CUDA_ATTENTION_OPTION
@click.option(
    "--portable/--no-portable",
    default=None,
    help="Also write the portable standard-op graph (needs optimum-onnx; what TensorRT takes) "
    "[on]. Without it each model's graph is its engine.",
)
@click.option("--force", is_flag=True, help="Replace an existing bundle at --out.")
@_friendly_errors
def export(target, draft, out, recipe, force, **given) -> None:
    """Export a target/draft pair of HF checkpoints into one ONNX bundle."""
    _require_export_extra("export", portable=False)  # the rest, once the options are known
    from specrt.export.options import ExportOptions
    from specrt.export.pipeline import export_bundle
    from specrt.export.recipes import resolve_recipe

    recipe_options: dict = {}
    if recipe is not None:
        if target or draft:
            raise click.UsageError("give either --recipe or --target/--draft, not both")
        target, draft, out, recipe_options = resolve_recipe(recipe, out)
    elif not (target and draft and out):
        raise click.UsageError("give --target, --draft and --out (or --recipe)")
    given["slim"] = given["slim"] or None  # an absent flag leaves the recipe's choice
    given["devices"] = given["devices"] or None
    options = ExportOptions.from_settings(recipe_options, given)
    _require_export_extra("export", options.portable)
    log = lambda message: click.echo(message, err=True)  # noqa: E731
    manifest = export_bundle(target, draft, out, options, force=force, log=log)
    for role, spec in manifest.models.items():
        engines = "".join(
            f", {name} engine ({e.precision}) {e.export_check['max_abs_logit_diff']:.2e}"
            for name, e in spec.engines.items()
        )
        click.echo(
            f"{role}: {spec.architecture}, {spec.num_layers} layers, vocab {spec.vocab_size}, "
            f"max |logit diff| {spec.export_check['max_abs_logit_diff']:.2e}{engines}"
        )
    click.echo(f"bundle: {out}")


def _require_export_extra(command: str, portable: bool = True) -> None:
    """The export stack is imported only once a model is read: name what is missing first
    (optimum writes the portable graphs alone)."""
    needed = [name for name in EXPORT_MODULES if portable or name != "optimum"]
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise click.ClickException(
            f"specrt {command} needs the export extra ({', '.join(missing)} missing): "
            f"{EXPORT_EXTRA}"
        )


# ------------------------------------------------------------------------------------------------
@main.command()
@click.option("--bundle", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@draft_precision_option(DEFAULT_DRAFT_PRECISION)
@DEVICE_OPTION
@CUDA_ATTENTION_OPTION
@click.option(
    "--atol", type=float, default=DEFAULT_ATOL, show_default=True, help="Max |logit diff|."
)
@click.option(
    "--tensorrt",
    is_flag=True,
    help="Build TensorRT plans of the portable graphs instead (needs the tensorrt extra and an "
    "NVIDIA GPU; a plan runs only on the GPU model and TensorRT version it was built with).",
)
@_friendly_errors
def build(bundle, draft_precision, devices, cuda_attention, atol, tensorrt) -> None:
    """(Re)build a bundle's onnxruntime engines from the checkpoints it was exported from."""
    if tensorrt:
        if devices or cuda_attention:
            raise click.UsageError(
                "--tensorrt builds plans of the portable graphs: --device and --cuda-attention "
                "are for the onnxruntime engines; give them in a build of their own"
            )
        from specrt.export.tensorrt_plans import build_plans

        manifest = build_plans(bundle, log=lambda message: click.echo(message, err=True))
        for role, spec in manifest.models.items():
            built_for = spec.engines["tensorrt"].built_for
            click.echo(f"{role}: TensorRT plan for {built_for['gpu']}, {built_for['tensorrt']}")
        click.echo(f"bundle: {bundle}")
        return
    _require_export_extra("build", portable=False)
    from specrt.export.build import build_engines
    from specrt.export.options import ExportOptions

    try:  # every one of them from the command line: a bad one is a usage error
        options = ExportOptions(
            atol=atol,
            draft_precision=draft_precision,
            devices=devices or ("cpu",),
            cuda_attention=cuda_attention or "batched",
        )
    except ExportError as exc:
        raise click.UsageError(str(exc)) from exc
    manifest = build_engines(bundle, options, log=lambda message: click.echo(message, err=True))
    for role, spec in manifest.models.items():
        names = ", ".join(f"{n} ({e.precision})" for n, e in spec.engines.items()) or "none"
        click.echo(f"{role}: engines {names}")
    click.echo(f"bundle: {bundle}")


# ------------------------------------------------------------------------------------------------
@main.command()
@click.option("--bundle", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable).")
@click.option(
    "--prompt-file",
    type=click.Path(path_type=Path),
    help='Prompts, one per line; a .jsonl file holds {"prompt": ...} objects or JSON strings '
    '(prompts of several lines), with --chat also {"messages": [...]} conversations; "-": stdin.',
)
@click.option(
    "--chat",
    is_flag=True,
    help="Render each prompt as a user's message (and each messages line as a conversation) "
    "with the bundle's chat template, as `specrt serve`'s chat route does.",
)
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
    as_json,
    threads,
    engine,
    max_length,
    skip_checksums,
    compare,
    **params,
) -> None:
    """Generate from a bundle with speculative decoding."""
    from specrt.runtime.comparison import compare_with_target_only

    texts = _prompts(prompts, prompt_file, chat)
    if chat:
        texts = _chat_prompts(bundle, texts)
    config = _generation_config(params, notes=True)
    generator = _load(bundle, threads, engine, max_length, skip_checksums)
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


def _load(bundle, threads, engine, max_length, skip_checksums, max_batch=1, suffix_tokens=0):
    """``suffix_tokens``: keep a suffix cache of that many tokens (0: none)."""
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
    )


@main.command()
@click.option("--bundle", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@click.option(
    "--input",
    "input_path",
    required=True,
    type=click.Path(path_type=Path),
    help='JSONL: {"id", "prompt" (or chat "messages"), optional "max_new_tokens", "temperature", '
    '"top_k", "top_p", "seed", "num_draft_tokens", "stop", "proposer"}, or OpenAI batch-file '
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
    suffix_cache,
    suffix_cache_tokens,
    threads,
    engine,
    max_length,
    skip_checksums,
    **params,
) -> None:
    """Run a JSONL file of prompts into a JSONL file of results (resumable, row errors kept).

    Up to --batch-size rows share each model call; the draft length adapts to the load (K = 0
    where drafting does not pay) unless --draft-schedule fixed is given."""
    from specrt.jobs.batch import preflight, progress_bar, run_batch, spooled

    to_stdout = str(output_path) == "-"
    if to_stdout:
        output_path = Path("/dev/stdout")
    elif _same_file(input_path, output_path):
        raise click.UsageError("--output must not be the --input file")
    else:
        output_path = _through_link(output_path, "--output")
        _check_writable(output_path, "--output")
    if summary is not None and str(summary) == "-":
        if to_stdout:
            raise click.UsageError("--output - and --summary - would both go to stdout")
        summary = Path("/dev/stdout")
    elif summary is not None:  # found now, not after the whole job
        if _same_file(summary, input_path) or _same_file(summary, output_path):
            raise click.UsageError("--summary must not be the --input or the --output file")
        summary = _through_link(summary, "--summary")
        _check_writable(summary, "--summary")
    defaults = _generation_config(params)
    suffix_tokens = suffix_cache_tokens if suffix_cache else 0
    with spooled(input_path) as rows:  # stdin or a pipe: read twice (ids first), so spooled
        name = _spooled_name(input_path, rows)
        preflight(rows, output_path, output_format, name)  # not after minutes of loading
        plan = _cache_plan(bundle, kv_cache_memory, batch_size, max_length, engine)
        click.echo(f"specrt batch: {plan.describe()}", err=True)
        generator = _load(
            bundle, threads, engine, plan.max_length, skip_checksums, plan.max_batch, suffix_tokens
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


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (the same path, a symbolic or a hard link)."""
    try:
        return a.resolve() == b.resolve() or os.path.samefile(a, b)
    except (OSError, RuntimeError):  # one of them does not exist (yet), or loops
        return False


def _spooled_name(input_path: Path, rows: Path) -> str | None:
    """How errors name an input read through a spooled copy (stdin, a pipe); None: as is."""
    if rows == input_path:
        return None
    return "standard input" if str(input_path) == "-" else str(input_path)


def _through_link(path: Path, option: str) -> Path:
    """Where a symbolic link to nothing yet points (missing folders on the way are made there,
    not beside the link); any other path as it is (opening it follows a live link, such as
    /dev/stdout to a pipe, which has no path of its own)."""
    if path.is_symlink() and not path.exists():
        try:
            os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise click.UsageError(f"{option} {path} is a loop of symbolic links") from exc
        return Path(os.path.realpath(path))
    return path


def _check_writable(path: Path, option: str) -> None:
    """Refuse, before any work, a file the job could not write at its end: a directory, one
    under a file, or where writing is not allowed."""
    if path.is_dir():
        raise click.UsageError(f"{option} {path} is a directory; give a file")
    if path.exists():
        if not os.access(path, os.W_OK):
            why = unwritable_reason(path)
            raise click.UsageError(f"{option} {path} cannot be written ({why})")
        return
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise click.UsageError(f"{option} {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        why = unwritable_reason(folder)
        raise click.UsageError(f"{option} {path}: cannot write in {folder} ({why})")


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


@main.command()
@click.option("--bundle", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--model-name", default=None, help="The model id clients ask for [bundle name].")
@click.option(
    "--api-key",
    envvar="SPECRT_API_KEY",
    show_envvar=True,
    default=None,
    help="Clients must send it as a bearer token on /v1 (/health and /metrics stay open).",
)
@click.option(
    "--batch-size",
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
    num_draft_tokens,
    draft_schedule,
    log_level,
    proposer,
    suffix_cache,
    suffix_cache_tokens,
    kv_cache_memory,
    threads,
    engine,
    max_length,
    skip_checksums,
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
    sock = listen(host, port)  # a taken port fails now, not after the load
    log = configure_logging(log_level)  # stdout, as vLLM's; errors that end it: stderr
    suffix_tokens = suffix_cache_tokens if suffix_cache else 0
    plan = _cache_plan(bundle, kv_cache_memory, batch_size, max_length, engine)
    # taken at start: no request waits for an allocation
    log.info("specrt serve: %s, taken at start", plan.describe("requests"))
    generator = _load(
        bundle, threads, engine, plan.max_length, skip_checksums, plan.max_batch, suffix_tokens
    )
    defaults = _generation_config(
        dict(num_draft_tokens=num_draft_tokens, draft_schedule=draft_schedule, proposer=proposer)
    )
    name = model_name or Path(bundle).resolve().name
    run_server(
        generator, name, defaults, host=host, port=port, max_waiting=max_waiting, sock=sock,
        api_key=api_key, log_level=log_level,
    )  # fmt: skip


@main.command()
@click.option("--bundle", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable).")
@click.option(
    "--prompt-file",
    type=click.Path(path_type=Path),
    help='Prompts, one per line; a .jsonl file holds {"prompt": ...} objects or JSON strings '
    '(prompts of several lines); "-": stdin.',
)
@click.option("--num-prompts", type=click.IntRange(min=1), default=None, help="Use the first N.")
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

    texts = _prompts(prompts, prompt_file)[:num_prompts]
    if plot:  # found now, not after the whole benchmark
        _check_writable(Path(plot), "--plot")
        check_plot_path(Path(plot))
    report = run_benchmark(
        bundle,
        texts,
        max_new_tokens=max_new_tokens,
        threads=threads,
        ks=tuple(range(1, max_draft_tokens + 1)),
        with_transformers=not no_transformers,
        engine=engine,
        genai=(genai_python, genai_models) if genai_python else None,
        log=lambda message: click.echo(message, err=True),
    )
    click.echo(json.dumps(report) if as_json else table(report))
    if plot:
        draw(report, plot)


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


if __name__ == "__main__":
    main()

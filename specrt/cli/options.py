"""The options several commands take, declared once."""

from __future__ import annotations

import os

import click

from specrt.backends import DEFAULT_MAX_LENGTH, ENGINE_CHOICES
from specrt.cli.common import DEFAULTS
from specrt.export.options import (
    CUDA_ATTENTIONS,
    CUDA_REDUCTIONS,
    DEFAULT_DRAFT_PRECISION,
    DEFAULT_TARGET_BLOCK_SIZE,
    DEVICES,
    PRECISIONS,
    TARGET_BLOCK_SIZES,
)
from specrt.openai_tools import PARSERS
from specrt.runtime.config import DRAFT_SCHEDULES, PROPOSERS
from specrt.runtime.loading import MAX_THREADS_PER_CPU
from specrt.runtime.lookup import DEFAULT_SUFFIX_TOKENS

TOOL_PARSER_OPTION = click.option(
    "--tool-call-parser",
    type=click.Choice(PARSERS),
    default=None,
    help="The format of the model's own tool calls, which a chat's tool_choice \"auto\" (the "
    "default with tools) reads out of its text: hermes, <tool_call>{...}</tool_call> (Hermes, "
    'Qwen); llama3_json, {"name": ..., "parameters": {...}} (Llama 3.1); pythonic, '
    '[f(x=1)] (Llama 3.2, 4); mistral, [TOOL_CALLS][...] (Mistral). Without it "auto" is '
    'refused; "required" and a named function need none.',
)

CHAT_TEMPLATE_OPTION = click.option(
    "--chat-template",
    default=None,
    help="The chat template to render chats with, in place of the bundle's (as vLLM's flag): a "
    "Jinja file, or the template itself.",
)

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
    help="The cuda engine's graph [batched]: batched runs many rows per call; batched_lengths "
    "too, attending by each row's length (flash attention's form); group_query, one row per call "
    "on GroupQueryAttention's kernels (what soft-capped models always get).",
)

CUDA_REDUCTIONS_OPTION = click.option(
    "--cuda-reductions",
    type=click.Choice(CUDA_REDUCTIONS),
    default=None,
    help="How the cuda engines' greedy outputs reduce the vocabulary [chunked]: in two stages, "
    "or direct (one reduction a row); the same numbers (docs/gpu.md).",
)


KEPT = "as the bundle has it"  # `specrt build`'s default: what each engine has now


def draft_precision_option(default: str | None, shown: str = DEFAULT_DRAFT_PRECISION):
    return click.option(
        "--draft-precision",
        type=click.Choice(PRECISIONS),
        default=default,
        help=f"Weights of the draft's onnxruntime engine [{shown}]: cheaper drafting, same output.",
    )


def target_precision_option(default: str | None, shown: str = "float32"):
    return click.option(
        "--target-precision",
        type=click.Choice(PRECISIONS),
        default=default,
        help=f"Weights of the target's onnxruntime engine [{shown}]: int8/int4 make a faster "
        "target; the output then equals that engine's own output alone, not the float32 model's.",
    )


def target_block_size_option(default: int | None, shown: str = str(DEFAULT_TARGET_BLOCK_SIZE)):
    return click.option(
        "--target-block-size",
        type=click.Choice([str(size) for size in TARGET_BLOCK_SIZES]),
        callback=lambda context, parameter, value: None if value is None else int(value),
        default=None if default is None else str(default),
        help=f"An int8/int4 target's weights per scale [{shown}]: larger blocks make each "
        "verified position cheaper, and the model further from float32.",
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


def _setting(flag: str, kind: type, help: str):
    """An option for the `GenerationConfig` field of its name, with that field's default."""
    name = flag[2:].replace("-", "_")
    return click.option(flag, type=kind, default=DEFAULTS[name], show_default=True, help=help)


TOP_K_TOP_P_OPTIONS = _stack(
    _setting("--top-k", int, "0 = off."),
    _setting("--top-p", float, "1 = off."),
    _setting(
        "--min-p", float, "Drop tokens less likely than this times the most likely one; 0 = off."
    ),
)
PENALTY_OPTIONS = _stack(
    _setting(
        "--repetition-penalty",
        float,
        "Divide the positive logits (multiply the negative) of tokens in the prompt or the "
        "output by this; 1 = off.",
    ),
    _setting(
        "--frequency-penalty",
        float,
        "Subtract this times a token's count in the output from its logit; 0 = off.",
    ),
    _setting(
        "--presence-penalty",
        float,
        "Subtract this from the logit of each token the output holds; 0 = off.",
    ),
)
STRUCTURED_OPTIONS = _stack(
    click.option(
        "--json-schema",
        help="Hold the output to this JSON schema: a file, or the schema's JSON text.",
    ),
    click.option("--json-object", is_flag=True, help="Hold the output to a JSON object."),
    click.option("--regex", help="Hold the output to this regular expression."),
    click.option("--choice", multiple=True, help="Hold the output to one of these (repeatable)."),
    click.option("--grammar", help="Hold the output to this Lark grammar: a file, or its text."),
)
PROMPT_LOOKUP_OPTIONS = _stack(
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
    TOP_K_TOP_P_OPTIONS,
    PENALTY_OPTIONS,
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
        "--stop-token-id",
        "stop_token_ids",
        type=int,
        multiple=True,
        help="Stop at this token, as at EOS (repeatable; kept in the output's tokens).",
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
    STRUCTURED_OPTIONS,
    PROPOSER_OPTION,
    PROMPT_LOOKUP_OPTIONS,
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
        "--max-model-len",  # vLLM's name
        "max_length",
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
    click.option(
        "--corpus/--no-corpus",
        "use_corpus",
        default=True,
        show_default=True,
        help="Draft from the bundle's corpus of its target's text, where it has one (`specrt "
        "corpus`).",
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

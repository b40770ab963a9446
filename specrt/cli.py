"""specrt's command line: export a pair into a bundle, build recipes, generate from a bundle."""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import replace
from pathlib import Path

import click

from specrt.errors import SpecrtError


def _friendly_errors(command):
    """Turn specrt's own errors into a one-line message and exit status 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except SpecrtError as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper


ENGINE_OPTION = click.option(
    "--engine",
    type=click.Choice(["auto", "portable", "onnxruntime"]),
    default="auto",
    show_default=True,
    help="Which graphs run: each model's onnxruntime engine where the bundle has one (auto), or "
    "the portable ones.",
)


def draft_precision_option(default: str | None):
    return click.option(
        "--draft-precision",
        type=click.Choice(["float32", "int8", "int4"]),
        default=default,
        help="Weights of the draft's onnxruntime engine [int8]: cheaper drafting, same output.",
    )


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
@click.option("--atol", type=float, default=None, help="Max |logit diff| vs PyTorch [1e-3].")
@click.option("--opset", type=int, default=None, help="ONNX opset (default: optimum's).")
@click.option("--slim", is_flag=True, help="Simplify the graphs with onnxslim (standard ops).")
@click.option(
    "--ort-engine/--no-ort-engine",
    default=None,
    help="Also build the onnxruntime engine (fused graph, in-place KV cache) [on].",
)
@draft_precision_option(None)
@click.option("--force", is_flag=True, help="Replace an existing bundle at --out.")
@_friendly_errors
def export(
    target, draft, out, recipe, atol, opset, slim, ort_engine, draft_precision, force
) -> None:
    """Export a target/draft pair of HF checkpoints into one ONNX bundle."""
    try:
        from specrt.export.pipeline import DEFAULT_ATOL, DEFAULT_DRAFT_PRECISION, export_bundle
        from specrt.export.recipes import resolve_recipe
    except ImportError as exc:
        raise click.ClickException(
            f"specrt export needs the export extra ({exc.name} is missing): "
            "pip install torch==2.13.0 && pip install 'specrt[export]'"
        ) from exc
    if recipe is not None:
        if target or draft:
            raise click.UsageError("give either --recipe or --target/--draft, not both")
        target, draft, out, options = resolve_recipe(recipe, out)
        atol = atol if atol is not None else options.get("atol")
        opset = opset if opset is not None else options.get("opset")
        slim = slim or options.get("slim", False)
        ort_engine = ort_engine if ort_engine is not None else options.get("ort_engine")
        draft_precision = draft_precision or options.get("draft_precision")
    elif not (target and draft and out):
        raise click.UsageError("give --target, --draft and --out (or --recipe)")
    manifest = export_bundle(
        target,
        draft,
        out,
        atol=atol if atol is not None else DEFAULT_ATOL,
        force=force,
        opset=opset,
        slim=slim,
        ort_engine=ort_engine is not False,
        draft_precision=draft_precision or DEFAULT_DRAFT_PRECISION,
        log=lambda message: click.echo(message, err=True),
    )
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


# ------------------------------------------------------------------------------------------------
@main.command()
@click.option("--bundle", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@draft_precision_option("int8")
@click.option("--atol", type=float, default=1e-3, show_default=True, help="Max |logit diff|.")
@_friendly_errors
def build(bundle, draft_precision, atol) -> None:
    """(Re)build a bundle's onnxruntime engines from the checkpoints it was exported from."""
    try:
        from specrt.export.build import build_engines
    except ImportError as exc:
        raise click.ClickException(
            f"specrt build needs the export extra ({exc.name} is missing): "
            "pip install torch==2.13.0 && pip install 'specrt[export]'"
        ) from exc
    manifest = build_engines(
        bundle, draft_precision, atol, log=lambda message: click.echo(message, err=True)
    )
    for role, spec in manifest.models.items():
        names = ", ".join(f"{n} ({e.precision})" for n, e in spec.engines.items()) or "none"
        click.echo(f"{role}: engines {names}")
    click.echo(f"bundle: {bundle}")


# ------------------------------------------------------------------------------------------------
def _read_prompts(prompts: tuple[str, ...], prompt_file: Path | None) -> list[str]:
    """--prompt (repeatable) and --prompt-file: one prompt per line, or per JSON line in .jsonl
    files ({"prompt": ...} or a JSON string), for prompts that span lines."""
    collected = list(prompts)
    if prompt_file is not None:
        if not prompt_file.is_file():
            raise click.BadParameter(f"{prompt_file} does not exist", param_hint="--prompt-file")
        lines = prompt_file.read_text().splitlines()
        if prompt_file.suffix == ".jsonl":
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise click.BadParameter(
                        f"{prompt_file}:{number} is not JSON ({exc})", param_hint="--prompt-file"
                    ) from exc
                collected.append(item["prompt"] if isinstance(item, dict) else item)
        else:
            collected.extend(line for line in lines if line.strip())
    if not collected:
        raise click.UsageError("give a prompt with --prompt TEXT or --prompt-file FILE")
    return collected


@main.command()
@click.option("--bundle", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable).")
@click.option("--prompt-file", type=click.Path(path_type=Path), help="Prompts, one per line.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option(
    "--num-draft-tokens", type=int, default=4, show_default=True, help="K; 0 = target only."
)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off.")
@click.option("--seed", type=int, default=None, help="Seed for sampling (row i uses (seed, i)).")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the end-of-sequence token.")
@click.option(
    "--adaptive-draft", is_flag=True, help="Choose K per round (at most --num-draft-tokens)."
)
@click.option(
    "--draft-schedule",
    type=click.Choice(["fixed", "adaptive", "heuristic"]),
    default="fixed",
    show_default=True,
    help="How many tokens each round drafts (adaptive = --adaptive-draft).",
)
@click.option("--threads", type=int, default=None, help="onnxruntime intra-op threads.")
@ENGINE_OPTION
@click.option(
    "--max-length",
    type=click.IntRange(min=2),
    default=8192,
    show_default=True,
    help="Longest prompt + output the engines' preallocated KV caches hold (capped at the "
    "model's max positions).",
)
@click.option(
    "--compare", is_flag=True, help="Also run the target alone and report the measured speedup."
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt.")
@_friendly_errors
def generate(
    bundle, prompts, prompt_file, as_json, threads, engine, max_length, compare, **params
) -> None:
    """Generate from a bundle with speculative decoding."""
    from specrt.runtime import GenerationConfig, SpeculativeGenerator

    texts = _read_prompts(prompts, prompt_file)
    config = GenerationConfig(**params)
    generator = SpeculativeGenerator.from_bundle(
        bundle, threads=threads, engine=engine, max_length=max_length
    )
    generator.encode_prompts(texts)  # every prompt is checked before any work starts
    baseline_config = GenerationConfig(**{**params, "num_draft_tokens": 0})
    if compare:  # first calls pay one-off costs: warm both modes up before timing either
        for warm in (config, baseline_config):
            generator.generate(
                texts[:1], replace(warm, max_new_tokens=min(8, config.max_new_tokens))
            )
    for text, result in zip(texts, generator.stream(texts, config)):
        record = result.to_dict()
        if compare:
            [baseline] = generator.generate([text], baseline_config)
            record["comparison"] = {
                "target_only_tokens_per_second": baseline.stats.tokens_per_second,
                "speedup": result.stats.tokens_per_second / baseline.stats.tokens_per_second,
                "identical_output": baseline.token_ids == result.token_ids,
            }
        if as_json:
            click.echo(json.dumps(record))
        else:
            _print_human(text, record)
        sys.stdout.flush()


@main.command()
@click.option("--bundle", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable).")
@click.option("--prompt-file", type=click.Path(path_type=Path), help="Prompts, one per line.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=None, help="Use the first N.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--max-draft-tokens", type=click.IntRange(1, 16), default=8, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Threads for everyone.")
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
    default=Path("build/genai"),
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
    from specrt.bench.report import plot as draw
    from specrt.bench.report import table
    from specrt.bench.runner import run_benchmark

    texts = _read_prompts(prompts, prompt_file)[:num_prompts]
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
        f"{stats['tokens_per_second']:.1f} tokens/s, acceptance {stats['acceptance_rate']:.2f}, "
        f"{stats['tokens_per_round']:.2f} tokens/round"
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

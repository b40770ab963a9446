"""`specrt verify`: audit a bundle's losslessness with the user's settings, one line per check."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from specrt.cli.common import (
    DEFAULTS,
    _chat_prompts,
    _friendly_errors,
    _generation_config,
    _load,
    _prompts,
)
from specrt.cli.options import (
    PENALTY_OPTIONS,
    PROMPT_LOOKUP_OPTIONS,
    PROPOSER_OPTION,
    STRUCTURED_OPTIONS,
    TOP_K_TOP_P_OPTIONS,
    load_options,
)
from specrt.runtime.audit import (
    AUDIT_BATCH,
    DEFAULT_ALPHA,
    DEFAULT_LAW_PROMPTS,
    DEFAULT_PROMPTS,
    DEFAULT_SAMPLES,
    DEFAULT_SEED,
    DEFAULT_TEMPERATURE,
    MIN_SAMPLES,
    run_checks,
    sampled_config,
)
from specrt.runtime.config import DRAFT_SCHEDULES, MAX_DRAFT_TOKENS, GenerationConfig


@click.command()
@click.option("--bundle", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt text (repeatable).")
@click.option(
    "--prompt-file",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Prompts, one per line (repeatable: each file in turn); a .jsonl file holds "
    '{"prompt": ...} objects or JSON strings; '
    f'"-": stdin. Default: {len(DEFAULT_PROMPTS)} short built-in prompts.',
)
@click.option(
    "--chat",
    is_flag=True,
    help="Render each prompt as a user's message with the bundle's chat template.",
)
@click.option(
    "--samples",
    type=click.IntRange(min=MIN_SAMPLES),
    default=DEFAULT_SAMPLES,
    show_default=True,
    help="Sampled rows per prompt for the law of the first two new tokens.",
)
@click.option(
    "--alpha",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=DEFAULT_ALPHA,
    show_default=True,
    help="False-alarm rate of each sampled-law check: a correct runtime fails it this often.",
)
@click.option(
    "--law-prompts",
    type=click.IntRange(min=0),
    default=DEFAULT_LAW_PROMPTS,
    show_default=True,
    help="How many of the prompts (the first) the sampled-law check runs on.",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=DEFAULTS["max_new_tokens"],
    show_default=True,
    help="Tokens per prompt compared in the identity checks.",
)
@click.option(
    "--num-draft-tokens",
    type=click.IntRange(1, MAX_DRAFT_TOKENS),
    default=DEFAULTS["num_draft_tokens"],
    show_default=True,
    help="K, the draft tokens a round (as for generate).",
)
@PROPOSER_OPTION
@click.option(
    "--draft-schedule",
    type=click.Choice(DRAFT_SCHEDULES),
    default=DEFAULTS["draft_schedule"],
    show_default=True,
    help="How many tokens each round drafts (the sampled checks draft K every round where it "
    "is adaptive).",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_TEMPERATURE,
    show_default=True,
    help="The sampled checks' temperature (greedy is checked as well).",
)
@TOP_K_TOP_P_OPTIONS
@PENALTY_OPTIONS
@STRUCTURED_OPTIONS
@click.option(
    "--seed",
    type=int,
    default=DEFAULT_SEED,
    show_default=True,
    help="The seed of the seeded-identity check.",
)
@PROMPT_LOOKUP_OPTIONS
@load_options
@_friendly_errors
def verify(
    bundle,
    prompts,
    prompt_file,
    chat,
    samples,
    alpha,
    law_prompts,
    threads,
    engine,
    max_length,
    skip_checksums,
    use_corpus,
    **params,
) -> None:
    """Audit that speculative decoding gives the target's own output on this bundle.

    Greedy and seeded outputs must equal the target alone's, token for token (a batch, and
    one prompt at a time); unseeded samples of the first two new tokens must follow the
    target's exact law (chi-square). Exit status 1 when any check fails."""
    started = time.perf_counter()
    texts = list(DEFAULT_PROMPTS)
    if prompts or prompt_file:
        texts = _prompts(prompts, prompt_file, chat)
    if chat:
        texts = _chat_prompts(bundle, texts)
    config = _generation_config(params)
    generator = _load(
        bundle,
        threads,
        engine,
        max_length,
        skip_checksums,
        max_batch=AUDIT_BATCH,
        use_corpus=use_corpus,
    )
    inputs = texts
    if chat:  # the template writes its special tokens out: none added (as the server does)
        inputs = [generator.tokenizer.encode(text, add_special_tokens=False) for text in texts]
    click.echo(_header(bundle, len(inputs), config))
    results = []
    checks = run_checks(generator, inputs, samples, config, alpha, law_prompts, _progress_bar())
    for result in checks:
        results.append(result)
        click.echo(str(result))
        sys.stdout.flush()
    failed = [result for result in results if not result.passed]
    untested = sum(not result.tested for result in results)
    laws = sum("law" in result.name and result.tested for result in results)
    seconds = time.perf_counter() - started
    tested = len(results) - untested
    summary = f"{tested - len(failed)} of {tested} checks passed in {seconds:.0f} s"
    if untested:  # said, not counted as passed
        summary += f", {untested} not tested (each says why above)"
    if laws:  # each law check fails a correct runtime with probability alpha
        together = min(1.0, laws * alpha)
        summary += f" (false-alarm rate of the sampled-law checks together <= {together:.2g})"
    if failed:
        click.echo(f"FAIL: {summary}: the output is not the target's with these settings")
        sys.exit(1)
    if not tested:  # an audit that tested nothing is no pass
        click.echo(f"NOT TESTED: {summary}: nothing was audited with these settings")
        sys.exit(1)
    click.echo(f"PASS: {summary}")


def _header(bundle: Path, prompts: int, config: GenerationConfig) -> str:
    sampled = sampled_config(config)
    filters = "".join(
        [
            f", top-k {sampled.top_k}" if sampled.top_k else "",
            f", top-p {sampled.top_p:g}" if sampled.top_p < 1 else "",
            f", min-p {sampled.min_p:g}" if sampled.min_p > 0 else "",
            _penalties(config),
            ", structured output" if config.structured_output else "",
        ]
    )
    return (
        f"specrt verify {bundle}: {prompts} prompt{'s' if prompts != 1 else ''}; proposer "
        f"{config.proposer}, K {'=' if config.draft_schedule == 'fixed' else '<='} "
        f"{config.num_draft_tokens}, {config.draft_schedule} schedule "
        f"(sampled checks: {sampled.draft_schedule}, temperature {sampled.temperature:g}"
        f"{filters})"
    )


def _progress_bar():
    """A bar on stderr (where it is a terminal) for each sampled-law check: minutes of rows on
    a larger target, which printed nothing meanwhile."""
    from tqdm import tqdm

    bars = {}

    def progress(name: str, done: int, total: int) -> None:
        if name not in bars:
            bars[name] = tqdm(total=total, desc=name, unit="row", leave=False, disable=None)
        bars[name].update(done - bars[name].n)
        if done == total:
            bars.pop(name).close()

    return progress


def _penalties(config: GenerationConfig) -> str:
    """The penalties ``config`` sets, as the header names them."""
    off = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    return "".join(
        f", {name.replace('_', ' ')} {getattr(config, name):g}"
        for name, value in off.items()
        if getattr(config, name) != value
    )

"""`specrt distill`: train a draft for a target from the target's own answers."""

from __future__ import annotations

from pathlib import Path

import click

from specrt.cli.common import _as_option, _friendly_errors, _prompts
from specrt.cli.options import target_block_size_option
from specrt.errors import ExportError
from specrt.export.options import DEFAULT_TARGET_BLOCK_SIZE, PRECISIONS


@click.command()
@click.option(
    "--target",
    required=True,
    type=click.Path(path_type=Path),
    help="HF checkpoint dir of the target, or a GGUF file (or a folder holding one).",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="Checkpoint directory to write the draft to.",
)
@click.option(
    "--prompt-file",
    type=click.Path(path_type=Path),
    multiple=True,
    help='Training prompts (.jsonl of {"prompt": ...}, or one per line), answered by '
    "the target through its chat template; repeat it to train on several sets.",
)
@click.option(
    "--heldout-file",
    type=click.Path(path_type=Path),
    help="Prompts never trained on: the acceptance report's.",
)
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="The draft is the target's first LAYERS layers (with its embeddings, final "
    "norm and output layer).",
)
@click.option(
    "--steps",
    type=click.IntRange(min=0),
    default=1500,
    show_default=True,
    help="Training steps (0: the draft as cut, or as --init-from gives it).",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option(
    "--seq-len",
    type=click.IntRange(min=8),
    default=192,
    show_default=True,
    help="Tokens of one training example (prompt and answer).",
)
@click.option(
    "--lr",
    type=click.FloatRange(min=0, min_open=True),
    default=5e-4,
    show_default=True,
    help="Peak learning rate.",
)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="Length of the target's answers.",
)
@click.option(
    "--top-k",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Target probabilities kept per answer token (soft targets).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--save-every",
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help="Steps between checkpoints (a killed run resumes from the last).",
)
@click.option(
    "--init-from",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Own weights (own_weights.safetensors) to start from; with --steps 0, the "
    "draft they make, put together again with the target.",
)
@click.option(
    "--kind",
    type=click.Choice(["draft", "eagle3"]),
    default="draft",
    show_default=True,
    help="draft: a draft model cut from the target; eagle3: an EAGLE-3 head, for "
    "`specrt export --eagle`.",
)
@click.option(
    "--draft-vocab",
    "--head-vocab",
    "vocab",
    type=click.IntRange(min=2),
    default=8192,
    show_default=True,
    help="The tokens the draft or head proposes, the answers' most used (a draft's output layer "
    "is a large part of its step); at least the vocabulary: all.",
)
@click.option(
    "--state-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Where the target's answers and the training checkpoint are kept [.OUT.distill beside "
    "--out]; a draft and a head of one target can share the answers.",
)
@click.option(
    "--chat-template/--no-chat-template",
    default=True,
    show_default=True,
    help="Send the prompts through the target's chat template where it has one; "
    "--no-chat-template: as plain text, as completions do (train on the text it will serve).",
)
@click.option(
    "--bf16/--no-bf16",
    default=None,
    help="Matrix products in bfloat16 while training (weights stay float32) and while the target "
    "answers the training prompts (held-out ones: float32) [on where the CPU has bfloat16 "
    "instructions].",
)
@click.option(
    "--target-precision",
    type=click.Choice(PRECISIONS),
    default="float32",
    show_default=True,
    help="--kind eagle3: train the head for the target engine of this precision (export the "
    "bundle with the same --target-precision): it learns that engine's answers and states.",
)
@target_block_size_option(DEFAULT_TARGET_BLOCK_SIZE)
@click.option("--force", is_flag=True, help="Replace an existing --out.")
@_friendly_errors
def distill(
    target,
    out,
    prompt_file,
    heldout_file,
    layers,
    steps,
    batch_size,
    seq_len,
    lr,
    max_new_tokens,
    top_k,
    seed,
    save_every,
    init_from,
    kind,
    vocab,
    state_dir,
    chat_template,
    bf16,
    target_precision,
    target_block_size,
    force,
) -> None:
    """Train a draft for a target from the target's own answers (sequence-level distillation).

    The draft starts as the target's first layers; what it learns is written as a checkpoint
    `specrt export --draft` takes. A killed run goes on where it stopped when run again with the
    same options.
    """
    from specrt.cli.export import _require_export_extra

    _require_export_extra("distill", portable=False)
    from specrt.distill import DistillSettings
    from specrt.distill import distill as run
    from specrt.distill.train import TrainSettings, native_bf16

    given = click.get_current_context().get_parameter_source("layers")
    if kind == "eagle3" and given is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError(
            "--layers cuts a draft model from the target (--kind draft); an EAGLE-3 head is one "
            "layer of its own: leave --layers out"
        )
    if steps and not prompt_file:
        raise click.UsageError("give --prompt-file (the prompts the target answers), or --steps 0")
    prompts = [prompt for path in prompt_file for prompt in _prompts((), path, chat=None)]
    heldout = _prompts((), heldout_file, chat=None) if heldout_file else []
    if steps and not prompts:
        raise click.UsageError(f"{', '.join(map(str, prompt_file))}: no prompts in them")
    settings = _checked(
        DistillSettings,
        kind=kind,
        vocab=vocab,
        layers=layers,
        max_new_tokens=max_new_tokens,
        top_k=top_k,
        chat_template=chat_template,
        target_precision=target_precision,
        target_block_size=target_block_size,
        train=TrainSettings(
            steps=steps,
            batch_size=batch_size,
            seq_len=seq_len,
            lr=lr,
            seed=seed,
            save_every=save_every,
            bf16=native_bf16() if bf16 is None else bf16,
        ),
    )
    report = run(
        target,
        out,
        prompts,
        heldout,
        settings,
        init_from=init_from,
        force=force,
        state=state_dir,
        log=lambda message: click.echo(message, err=True),
    )
    after = report["heldout_after"]
    if after:
        before = report["heldout_before"]
        positions = ", ".join(f"{a:.2f}" for a in after["acceptance_per_position"] if a is not None)
        click.echo(
            f"held-out greedy acceptance per drafted token {before['acceptance_per_token']:.3f} "
            f"-> {after['acceptance_per_token']:.3f}; per position (K={after['num_draft_tokens']}) "
            f"{positions}; {after['tokens_per_round']:.2f} tokens per round"
        )
    click.echo(f"{'EAGLE-3 head' if kind == 'eagle3' else 'draft'}: {out}")


def _checked(make, **settings):
    """``make(**settings)``, a bad combination of options a usage error in their words."""
    try:
        return make(**settings)
    except ExportError as exc:
        raise click.UsageError(_as_option(click.get_current_context(), exc)) from exc

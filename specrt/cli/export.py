"""`specrt export` and `specrt build`: checkpoints into a bundle, engines into an existing one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import click

from specrt.cli.common import EXPORT_EXTRA, EXPORT_MODULES, _as_option, _friendly_errors
from specrt.cli.options import (
    CUDA_ATTENTION_OPTION,
    CUDA_REDUCTIONS_OPTION,
    DEVICE_OPTION,
    KEPT,
    draft_precision_option,
    target_block_size_option,
    target_precision_option,
)
from specrt.errors import (
    ExportError,
)
from specrt.export.options import (
    DEFAULT_ATOL,
    DEFAULT_DRAFT_PRECISION,
    DEFAULT_TARGET_BLOCK_SIZE,
)


@click.command()
@click.option(
    "--target",
    type=click.Path(path_type=Path),
    help="HF checkpoint dir of the target, or a GGUF file (or a folder holding one).",
)
@click.option(
    "--draft",
    type=click.Path(path_type=Path),
    help="HF checkpoint dir of the draft, or a GGUF file (or a folder holding one).",
)
@click.option(
    "--eagle",
    type=click.Path(path_type=Path),
    help="An EAGLE-3 head's dir (its authors' layout) to draft with, in place of --draft.",
)
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
@target_precision_option(None)
@target_block_size_option(None)
@DEVICE_OPTION
@CUDA_ATTENTION_OPTION
@CUDA_REDUCTIONS_OPTION
@click.option(
    "--portable/--no-portable",
    default=None,
    help="Also write the portable standard-op graph (needs optimum-onnx; what TensorRT takes) "
    "[on]. Without it each model's graph is its engine.",
)
@click.option("--force", is_flag=True, help="Replace an existing bundle at --out.")
@_friendly_errors
def export(target, draft, eagle, out, recipe, force, **given) -> None:
    """Export a target/draft pair of HF checkpoints (or a target and its EAGLE-3 head) into one
    ONNX bundle."""
    if eagle is not None:
        if draft is not None:
            raise click.UsageError("give either --draft or --eagle: a bundle drafts with one")
        draft = eagle
    _require_export_extra("export", portable=False)  # the rest, once the options are known
    from specrt.export.onnx_export import check_opset
    from specrt.export.options import ExportOptions
    from specrt.export.pipeline import export_bundle
    from specrt.export.recipes import resolve_recipe

    recipe_options: dict = {}
    if recipe is not None:
        if target or draft:
            raise click.UsageError("give either --recipe or --target/--draft, not both")
        target, draft, out, recipe_options = resolve_recipe(recipe, out)
    elif not (target and draft and out):
        raise click.UsageError("give --target, --draft (or --eagle) and --out (or --recipe)")
    given["slim"] = given["slim"] or None  # an absent flag leaves the recipe's choice
    given["devices"] = given["devices"] or None
    try:
        options = ExportOptions.from_settings(recipe_options, given)
        check_opset(options.opset)
    except ExportError as exc:  # the recipe's or the command line's: named as the user gave it
        raise click.ClickException(_as_option(click.get_current_context(), exc)) from exc
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


def _kept_settings(bundle: Path) -> dict:
    """The precisions and block size the bundle's CPU engines have now (the defaults where it
    has none): a rebuild for another reason must not turn an int4 target into float32."""
    from specrt.bundle import ONNXRUNTIME_ENGINE, read_manifest

    models = read_manifest(bundle).models
    draft, target = (models[role].engines.get(ONNXRUNTIME_ENGINE) for role in ("draft", "target"))
    return {
        "draft_precision": draft.precision if draft else DEFAULT_DRAFT_PRECISION,
        "target_precision": target.precision if target else "float32",
        "target_block_size": (target and target.block_size) or DEFAULT_TARGET_BLOCK_SIZE,
    }


def _corpus_draft_vocab(bundle: Path, size: int):
    """The ``size`` tokens the bundle's corpus (`specrt corpus`: text its target wrote) uses
    most, sorted; all of them where ``size`` is 0 or more."""
    import numpy as np

    from specrt.bundle import read_manifest
    from specrt.export.build import EAGLE_VOCAB
    from specrt.runtime.corpus import CORPUS_FILE, CorpusTable

    manifest = read_manifest(bundle)
    if manifest.models["draft"].eagle_head:
        raise ExportError(EAGLE_VOCAB)
    vocab = manifest.vocab_size
    if size == 0 or size >= vocab:
        return np.arange(vocab)
    if not (bundle / CORPUS_FILE).is_file():
        raise ExportError(
            f"--draft-vocab {size} takes the tokens the bundle's corpus uses most, and {bundle} "
            f"has no corpus: build it first from text its target wrote (specrt corpus --bundle "
            f"{bundle} --text-file FILE), or leave --draft-vocab out"
        )
    table = CorpusTable.load(bundle / CORPUS_FILE, manifest.tokenizer.sha256, vocab)
    return table.most_used(vocab, size)


# ------------------------------------------------------------------------------------------------
@click.command()
@click.option("--bundle", required=True, type=click.Path(path_type=Path), help="Bundle directory.")
@draft_precision_option(None, KEPT)
@target_precision_option(None, KEPT)
@target_block_size_option(None, KEPT)
@DEVICE_OPTION
@CUDA_ATTENTION_OPTION
@CUDA_REDUCTIONS_OPTION
@click.option(
    "--atol", type=float, default=DEFAULT_ATOL, show_default=True, help="Max |logit diff|."
)
@click.option(
    "--tensorrt",
    is_flag=True,
    help="Build TensorRT plans of the portable graphs instead (needs the tensorrt extra and an "
    "NVIDIA GPU; a plan runs only on the GPU model and TensorRT version it was built with).",
)
@click.option(
    "--draft-vocab",
    type=click.IntRange(min=0),
    default=None,
    help="The draft's engine proposes only the N tokens the bundle's corpus uses most (build "
    "it first: `specrt corpus`): a cheaper draft step, the same output; 0: all of them. "
    "[those its checkpoint's draft_vocab.json names, if any]",
)
@_friendly_errors
def build(
    bundle,
    draft_precision,
    target_precision,
    target_block_size,
    devices,
    cuda_attention,
    cuda_reductions,
    atol,
    tensorrt,
    draft_vocab,
) -> None:
    """(Re)build a bundle's onnxruntime engines from the checkpoints it was exported from.

    Each engine keeps the precision (and a quantised target its block size) it has unless an
    option says otherwise."""
    if tensorrt:
        if devices or cuda_attention or cuda_reductions or draft_vocab is not None:
            raise click.UsageError(
                "--tensorrt builds plans of the portable graphs: --device, --cuda-attention, "
                "--cuda-reductions and --draft-vocab are for the onnxruntime engines; give "
                "them in a build of their own"
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

    kept = _kept_settings(bundle)
    target_precision = target_precision or kept["target_precision"]
    if target_precision != "float32":  # a float32 target keeps no block size
        target_block_size = target_block_size or kept["target_block_size"]
    try:  # every one of them from the command line: a bad one is a usage error
        options = ExportOptions(
            atol=atol,
            draft_precision=draft_precision or kept["draft_precision"],
            target_precision=target_precision,
            target_block_size=target_block_size or DEFAULT_TARGET_BLOCK_SIZE,
            devices=devices or ("cpu",),
            cuda_attention=cuda_attention or "batched",
            cuda_reductions=cuda_reductions or "chunked",
        )
    except ExportError as exc:
        raise click.UsageError(_as_option(click.get_current_context(), exc)) from exc
    proposed = None if draft_vocab is None else _corpus_draft_vocab(bundle, draft_vocab)
    log = lambda message: click.echo(message, err=True)  # noqa: E731
    manifest = build_engines(bundle, options, log, proposed)
    for role, spec in manifest.models.items():
        names = ", ".join(f"{n} ({e.precision})" for n, e in spec.engines.items()) or "none"
        click.echo(f"{role}: engines {names}")
    click.echo(f"bundle: {bundle}")


# ------------------------------------------------------------------------------------------------

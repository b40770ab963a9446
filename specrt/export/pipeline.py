"""export_bundle: two HF checkpoint directories -> one bundle directory.

The bundle is assembled in a scratch directory next to ``out`` and moved into place only when
every model passed its numeric check, so a failed export never leaves half a bundle behind and
never destroys a bundle that was already there.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from specrt import __version__
from specrt.bundle import (
    CUDA_ENGINE,
    ONNXRUNTIME_ENGINE,
    Manifest,
    ModelIO,
    ModelSpec,
    TokenizerSpec,
    write_manifest,
)
from specrt.checksums import sha256_file
from specrt.errors import ExportError, PairMismatchError
from specrt.export.checkpoint_hash import checkpoint_sha256
from specrt.export.checkpoints import (
    TOKENIZER_FILES,
    is_head,
    is_multimodal,
    load_checked,
    load_config,
    save_text_decoder,
    text_config,
)
from specrt.export.destination import check_destination, keep_users_files
from specrt.export.gguf_checkpoints import as_folders, gguf_file
from specrt.export.options import ExportOptions, target_tag
from specrt.export.ort_builder import FEATURES as FEATURE_OUTPUT
from specrt.export.tokenizer_compare import canonical_hash, describe_difference, load_tokenizer_json
from specrt.staging import publish, staging

Log = Callable[[str], None]


def export_bundle(
    target_dir: str | Path,
    draft_dir: str | Path,
    out_dir: str | Path,
    options: ExportOptions | None = None,
    force: bool = False,
    log: Log = lambda message: None,
    **option_values: Any,
) -> Manifest:
    """Export target and draft to ONNX, check both against PyTorch, write the bundle.

    ``options`` (or its fields as keywords, e.g. ``slim=True``): see `ExportOptions`. The
    portable standard-op graph is always written (TensorRT takes that one); with
    ``ort_engine`` each model also gets its onnxruntime engine (`specrt.export.ort_graph`)
    where the architecture allows, which the runtime prefers."""
    from specrt.export.onnx_export import check_opset

    options = options or ExportOptions()
    if option_values:
        options = ExportOptions.from_settings(vars(options), option_values)
    check_opset(options.opset)
    out = Path(os.path.abspath(out_dir))
    given = {"target": Path(target_dir), "draft": Path(draft_dir)}
    check_destination(out, list(given.values()), force)
    if is_head(given["draft"]):  # an EAGLE-3 head drafts: the target computes its features
        given.pop("draft")
    ggufs = {role: found for role, path in given.items() if (found := gguf_file(path, role))}
    with as_folders(given, ggufs, out, log) as sources:
        if "draft" not in sources:
            manifest = _export_with_head(
                sources["target"], Path(draft_dir), out, options, log, ggufs.get("target")
            )
        else:
            manifest = _export_pair(sources, ggufs, out, options, log)
    log(f"bundle written to {out}")
    return manifest


def _export_pair(
    sources: dict[str, Path],
    ggufs: dict[str, Path],
    out: Path,
    options: ExportOptions,
    log: Log,
) -> Manifest:
    """`export_bundle` from Hugging Face folders (``ggufs``: the GGUF files some were read
    from, which the manifest names)."""
    configs = {role: load_config(path, role) for role, path in sources.items()}

    tokenizers = {role: load_tokenizer_json(path) for role, path in sources.items()}
    difference = describe_difference(tokenizers["target"], tokenizers["draft"])
    if difference:
        raise PairMismatchError(
            f"draft and target tokenizers differ: {difference}. The draft must share the "
            "target's tokenizer; pick a draft from the same model family"
        )
    tokenizer_hash = canonical_hash(tokenizers["target"])
    # Logits are cut to the tokenizer's vocabulary: models may pad their embeddings beyond it
    # (real Qwen pairs differ there), and padding ids can be neither decoded nor shared.
    vocab = _tokenizer_vocab_size(sources["target"])
    for role, config in configs.items():
        if text_config(config).vocab_size < vocab:
            raise PairMismatchError(
                f"the {role} model has {text_config(config).vocab_size} embeddings but the "
                f"tokenizer has "
                f"{vocab} tokens; this checkpoint does not belong with this tokenizer"
            )

    with staging(out, "partial") as scratch:
        specs: dict[str, ModelSpec] = {}
        for role, source in sources.items():
            log(f"exporting {role} ({configs[role].model_type}) from {source}")
            if is_multimodal(configs[role]):
                log(f"  {role}: exporting the text decoder of the multimodal checkpoint")
            specs[role] = _export_role(
                source, configs[role], scratch, role, tokenizer_hash, vocab, options, log
            )
            checks = [("portable", specs[role].export_check)] if options.portable else []
            checks += [
                (f"{name} engine, {e.precision}", e.export_check)
                for name, e in specs[role].engines.items()
            ]
            for name, check in checks:
                diff = check["max_abs_logit_diff"]
                log(f"  {role} {name}: max |logit diff| vs PyTorch {diff:.2e}")
        for role, found in ggufs.items():
            specs[role].source, specs[role].source_sha256 = str(found.resolve()), sha256_file(found)
        return _publish(specs, sources["target"], configs["target"], vocab, scratch, out, log)


def _publish(specs, target: Path, config, vocab: int, scratch: Path, out: Path, log) -> Manifest:
    """Write the manifest (and the target's tokenizer) into ``scratch`` and move it to ``out``."""
    manifest = Manifest(
        models=specs,
        tokenizer=_copy_tokenizer(target, scratch / "tokenizer", text_config(config)),
        vocab_size=vocab,
        specrt_version=__version__,
    )
    write_manifest(scratch, manifest)
    kept = keep_users_files(out, scratch, log)
    publish(scratch, out, kept)
    return manifest


def _export_with_head(
    target: Path, head_dir: Path, out: Path, options, log: Log, gguf: Path | None
) -> Manifest:
    """The bundle of ``target`` (read from ``gguf`` where given) drafted for by the EAGLE-3 head
    at ``head_dir``: the target's CPU engine computes its features, the head has its own."""
    from specrt.export.checkpoints import load_causal_lm
    from specrt.export.eagle import head_features, read_head
    from specrt.export.eagle_export import export_head

    config = load_config(target, "target")
    head = read_head(head_dir, text_config(config))
    vocab = _tokenizer_vocab_size(target)
    tokenizer_hash = canonical_hash(load_tokenizer_json(target))
    cuda = "cuda" in options.devices  # the head in float16 too, beside the target's
    options = replace(options, ort_engine=True, devices=("cpu",) + ("cuda",) * cuda)
    model = load_causal_lm(target, config)
    features = head_features(head)
    with staging(out, "partial") as scratch:
        log(f"exporting target ({config.model_type}) from {target}, with the head's features")
        if options.portable:
            spec = _export_role(target, config, scratch, "target", tokenizer_hash, vocab, options,
                                log, features, model)  # fmt: skip
        else:
            spec = _engines_only(
                model, text_config(config), scratch, "target", tokenizer_hash, vocab, options,
                log, target, features,
            )  # fmt: skip
        if gguf is not None:
            spec.source, spec.source_sha256 = str(gguf.resolve()), sha256_file(gguf)
        log(f"exporting the EAGLE head from {head_dir} ({options.draft_precision})")
        _check_head_precision(head_dir, options, log)
        head_spec = export_head(head, head_dir, model, spec, scratch, vocab, tokenizer_hash,
                                precision=options.draft_precision,
                                fp16_atol=options.fp16_atol if cuda else None,
                                portable=options.portable)  # fmt: skip
        checks = {f"{name} engine": e.export_check for name, e in head_spec.engines.items()}
        if options.portable:
            checks = {"portable graph": head_spec.export_check, **checks}
        for name, check in checks.items():
            log(f"  EAGLE head {name}: max |logit diff| {check['max_abs_logit_diff']:.2e}")
        return _publish({"target": spec, "draft": head_spec}, target, config, vocab, scratch,
                        out, log)  # fmt: skip


def _check_head_precision(head_dir: Path, options, log: Log) -> None:
    """Say so where the head was trained (`specrt distill`'s report) for a target engine of
    another precision than this bundle's: it drafts all the same, its acceptance may differ."""
    report = head_dir / "distill_report.json"
    if not report.is_file():
        return
    try:
        trained = json.loads(report.read_text()).get("target_precision", "float32")
    except (OSError, ValueError, AttributeError):
        return
    precision = options.target_precision
    made = target_tag(precision, options.target_block_size)
    if trained != made:
        log(
            f"  note: the head was trained for the {trained} target (its distill_report.json), "
            f"this bundle's is {made}: `specrt distill --kind eagle3 --target-precision "
            f"{precision}` trains one on that engine's weights"
        )


def _export_role(source: Path, config, bundle_root: Path, role: str, *rest) -> ModelSpec:
    """`_export_checked` (``rest``: its other arguments) on the checkpoint, or on a multimodal
    checkpoint's text decoder saved on its own in the staging directory (removed after; the
    spec names the original checkpoint)."""
    if not is_multimodal(config):
        return _export_checked(source, config, bundle_root, role, *rest)
    text_dir = save_text_decoder(source, config, bundle_root / f".{role}-text-decoder")
    try:
        spec = _export_checked(text_dir, text_config(config), bundle_root, role, *rest)
    finally:
        shutil.rmtree(text_dir, ignore_errors=True)
    spec.source, spec.source_sha256 = str(source.resolve()), checkpoint_sha256(source)
    return spec


def _export_checked(
    source: Path,
    config,
    bundle_root: Path,
    role: str,
    tokenizer_hash: str,
    token_range: int,
    options: ExportOptions,
    log: Log,
    features=None,
    model=None,
) -> ModelSpec:
    """``features``: an EAGLE head's, which every graph of the target then computes
    (`ort_graph.EagleFeatures`); ``model``: the checkpoint, where it is loaded already."""
    from specrt.export.numeric_check import max_logit_difference

    model = model or load_checked(source, role)
    if not options.portable:
        return _engines_only(
            model, config, bundle_root, role, tokenizer_hash, token_range, options, log, source
        )
    from specrt.export.onnx_export import describe_model, export_onnx

    graph = export_onnx(source, bundle_root / role, options.opset, options.slim)
    if features is not None:
        from specrt.export.portable_eagle import add_features, features_difference

        add_features(graph, features)
    spec = describe_model(graph, bundle_root, config, tokenizer_hash)
    spec.source = str(source.resolve())
    spec.source_sha256 = checkpoint_sha256(source)
    check = max_logit_difference(model, graph, spec, token_range)
    if features is not None:
        spec.io.features = FEATURE_OUTPUT
        check.update(features_difference(model, graph, spec, features))
    spec.export_check = require_close(check, options.atol, role, source)
    if options.ort_engine:
        add_ort_engine(model, spec, config, bundle_root, role, token_range, options, log, features)
    return spec


def _engines_only(
    model,
    config,
    bundle_root: Path,
    role: str,
    tokenizer_hash: str,
    token_range: int,
    options: ExportOptions,
    log: Log,
    source: Path,
    features=None,
) -> ModelSpec:
    """A model without the portable graph (no optimum needed): its own graph is its first
    engine, a GPU one where asked for (``features``: see `add_ort_engine`)."""
    heads = int(config.num_attention_heads)
    spec = ModelSpec(
        path="",
        files={},
        architecture=(config.architectures or [type(config).__name__])[0],
        model_type=config.model_type,
        num_layers=int(config.num_hidden_layers),
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        vocab_size=int(config.vocab_size),
        max_positions=int(config.max_position_embeddings),
        dtype="float32",
        io=ModelIO("", None, None, [], [], "", [], []),
        tokenizer_hash=tokenizer_hash,
        source=str(source.resolve()),
        source_sha256=checkpoint_sha256(source),
    )
    add_ort_engine(model, spec, config, bundle_root, role, token_range, options, log, features)
    if not spec.engines:
        raise ExportError(
            f"{role}: {config.model_type} gets no engine here, and without the portable graph "
            "the bundle would have none: export with the portable graph"
        )
    first = spec.engines[CUDA_ENGINE if CUDA_ENGINE in spec.engines else ONNXRUNTIME_ENGINE]
    spec.path, spec.files, spec.io, spec.cache = first.path, first.files, first.io, first.cache
    spec.dtype, spec.vocab_size, spec.export_check = (
        first.dtype,
        first.vocab_size,
        first.export_check,
    )
    return spec


def add_ort_engine(
    model,
    spec: ModelSpec,
    config,
    bundle_root: Path,
    role: str,
    token_range: int,
    options: ExportOptions,
    log: Log,
    features=None,
    proposed: np.ndarray | None = None,
) -> None:
    """Build, check and record ``role``'s onnxruntime engine where the architecture allows
    (``features``: an EAGLE head's, `ort_graph.EagleFeatures`, computed by the CPU engine).
    ``proposed``: the tokens a draft's engine proposes (`specrt.export.draft_vocab`); None:
    those its folder names, if any."""
    from specrt.export.draft_vocab import DRAFT_VOCAB_FILE, read_draft_vocab
    from specrt.export.ort_engine import build_ort_engine
    from specrt.export.ort_graph import unsupported_reason
    from specrt.export.quantize import not_invariant

    source = Path(spec.source)
    where = "the bundle's corpus" if proposed is not None else DRAFT_VOCAB_FILE
    if role != "draft":
        proposed = None
    elif proposed is None:
        proposed = read_draft_vocab(source, token_range)
    elif len(proposed) == token_range:
        proposed = None
    if proposed is not None:
        log(f"  {role}: proposes {len(proposed)} of the {token_range} tokens ({where})")
    for device, wanted in (("cpu", options.cpu_engine), ("cuda", options.cuda_engine)):
        reason = wanted and unsupported_reason(config, spec.max_positions, device)
        if reason:
            log(f"  {role}: no {device} engine ({reason}); the portable graph will run there")
    if options.cpu_engine and not unsupported_reason(config, spec.max_positions, "cpu"):
        precision = options.draft_precision if role == "draft" else options.target_precision
        engine = build_ort_engine(
            model, spec, bundle_root, role, token_range, precision, features=features,
            block_size=options.target_block_size, proposed=proposed,
        )  # fmt: skip
        # a quantised engine is not meant to match PyTorch; it only has to be a number
        atol = options.atol if precision == "float32" else math.inf
        require_close(engine.export_check, atol, f"{role} onnxruntime engine", source)
        if role == "target" and (warning := not_invariant(engine.export_check, precision)):
            log(f"  warning: {warning}")
    if options.cuda_engine and not unsupported_reason(config, spec.max_positions, "cuda"):
        engine = build_ort_engine(
            model, spec, bundle_root, role, token_range, device="cuda",
            cuda_attention=options.cuda_attention, cuda_reductions=options.cuda_reductions,
            features=features, proposed=proposed,
        )  # fmt: skip
        require_close(engine.export_check, options.fp16_atol, f"{role} cuda engine", source)


def require_close(check: dict[str, float], atol: float, what: str, source: Path) -> dict:
    """Refuse a graph whose logits differ from PyTorch's by more than ``atol`` (math.inf: any
    finite difference, recorded as no bound)."""
    check["atol"] = atol if math.isfinite(atol) else None
    if not math.isfinite(check["max_abs_logit_diff"]):
        raise ExportError(
            f"{what}: the model produces NaN/inf logits (in PyTorch or ONNX) on a random prompt; "
            f"the checkpoint {source} is broken or needs float32"
        )
    if check["max_abs_logit_diff"] > atol:
        raise ExportError(
            f"{what}: ONNX logits differ from PyTorch by {check['max_abs_logit_diff']:.3g} "
            f"(> atol {atol}); the export is numerically wrong. Report it, or pass a larger "
            "--atol if the difference is acceptable for this model"
        )
    return check


def _tokenizer_vocab_size(checkpoint: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(checkpoint / "tokenizer.json")).get_vocab_size(
        with_added_tokens=True
    )


def _copy_tokenizer(source: Path, dest: Path, config) -> TokenizerSpec:
    from tokenizers import Tokenizer

    dest.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)
    tokenizer = Tokenizer.from_file(str(dest / "tokenizer.json"))
    generation = _read_json(source / "generation_config.json")
    tokenizer_config = _read_json(source / "tokenizer_config.json")

    def token_id(key: str) -> int | None:
        for holder in (generation, config.to_dict()):
            if holder.get(key) is not None:
                return holder[key]
        token = tokenizer_config.get(key.replace("_id", ""))
        if isinstance(token, dict):
            token = token.get("content")
        return tokenizer.token_to_id(token) if isinstance(token, str) else None

    eos = token_id("eos_token_id")
    eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    bos = token_id("bos_token_id")
    pad = token_id("pad_token_id")
    return TokenizerSpec(
        path="tokenizer",
        sha256=sha256_file(dest / "tokenizer.json"),
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        bos_token_id=None if bos is None or isinstance(bos, list) else int(bos),
        eos_token_ids=eos_ids,
        pad_token_id=None if pad is None or isinstance(pad, list) else int(pad),
    )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}

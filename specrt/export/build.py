"""`specrt build`: (re)build the onnxruntime engines of an existing bundle.

The engines are built from the checkpoints the bundle was exported from (``source`` in the
manifest), after checking that each checkpoint still is the model in the bundle: PyTorch's logits
must match the bundle's portable graph within ``atol``. The new bundle is assembled in a scratch
copy and swapped in only when every engine passed its check; a failure leaves the bundle as it was.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np

from specrt.bundle import (
    CUDA_ENGINE,
    ONNXRUNTIME_ENGINE,
    ROLES,
    Manifest,
    read_manifest,
    write_manifest,
)
from specrt.checksums import sha256_file, verify_checksums
from specrt.errors import ExportError
from specrt.export.checkpoint_hash import checkpoint_hashes
from specrt.export.checkpoints import load_causal_lm, text_config
from specrt.export.destination import refuse_mount_point
from specrt.export.gguf_checkpoints import as_folders
from specrt.export.options import ExportOptions
from specrt.export.pipeline import Log, add_ort_engine
from specrt.staging import publish, staging

EAGLE_VOCAB = (
    "--draft-vocab chooses a draft model's tokens, and this bundle drafts with an EAGLE-3 "
    "head, whose vocabulary is its own (its d2t table): leave it out"
)


def build_engines(
    bundle_dir: str | Path,
    options: ExportOptions | None = None,
    log: Log = lambda message: None,
    draft_vocab: np.ndarray | None = None,
) -> Manifest:
    """``options``: the engines' (``draft_precision``) and the check's (``atol``).
    ``draft_vocab``: the sorted token ids the draft's engine proposes (`specrt build
    --draft-vocab`: the bundle's corpus's most used); None: those its checkpoint's folder
    names (`specrt.export.draft_vocab`), if any."""
    from transformers import AutoConfig

    from specrt.export.numeric_check import max_logit_difference

    options = options or ExportOptions()
    root = Path(bundle_dir)
    manifest = read_manifest(root)
    refuse_mount_point(root, "--bundle")
    verify_checksums(manifest, root)
    sources = {role: Path(manifest.models[role].source) for role in ROLES}
    ggufs = {role: source for role, source in sources.items() if source.is_file()}
    _check_sources(manifest, sources, ggufs)
    if draft_vocab is not None and manifest.models["draft"].eagle_head:
        raise ExportError(EAGLE_VOCAB)
    if manifest.models["draft"].eagle_head:  # its portable graphs kept where it has them
        portable = manifest.models["target"].cache == "concat"
        return _rebuild_with_head(root, sources, replace(options, portable=portable), log)
    with as_folders(sources, ggufs, root, log) as folders, staging(root, "build") as scratch:
        shutil.copytree(root, scratch, dirs_exist_ok=True)
        for role in ROLES:
            spec = manifest.models[role]
            config = AutoConfig.from_pretrained(folders[role], local_files_only=True)
            model = load_causal_lm(folders[role], config)
            config = text_config(config)
            # before its engines go: without a portable graph the model's graph is one of them
            same = max_logit_difference(model, scratch / spec.path, spec, manifest.vocab_size)
            bound = spec.export_check.get("atol", options.atol)  # None: a quantised graph's
            if not same["max_abs_logit_diff"] <= (math.inf if bound is None else bound):
                raise ExportError(changed_message(role, sources[role]))
            keys = [ONNXRUNTIME_ENGINE] * options.cpu_engine + [CUDA_ENGINE] * options.cuda_engine
            for key in keys:  # the engines asked for are rebuilt; others are kept
                old = spec.engines.pop(key, None)
                if old is not None:
                    shutil.rmtree((scratch / old.path).parent, ignore_errors=True)
            log(f"building the {role} onnxruntime engine from {sources[role]}")
            add_ort_engine(
                model, spec, config, scratch, role, manifest.vocab_size, options, log,
                proposed=draft_vocab,
            )  # fmt: skip
            for engine in spec.engines.values():  # no portable graph: the model's is an engine
                if engine.path == spec.path:
                    spec.files, spec.io, spec.export_check = (
                        engine.files,
                        engine.io,
                        engine.export_check,
                    )
            for name, engine in spec.engines.items():
                diff = engine.export_check["max_abs_logit_diff"]
                log(f"  {role} {name} engine, {engine.precision}: max |logit diff| {diff:.2e}")
        write_manifest(scratch, manifest)
        publish(scratch, root)
    return manifest


def _check_sources(manifest: Manifest, sources: dict[str, Path], ggufs: dict[str, Path]) -> None:
    """Refuse checkpoints that are gone, or are no longer the ones the bundle was made from."""
    for role, source in sources.items():
        if not (source / "config.json").is_file() and role not in ggufs:
            raise ExportError(
                f"the {role} checkpoint this bundle was exported from ({source}) is gone; "
                "engines are built from it: re-export with `specrt export`"
            )
    for role, source in sources.items():
        recorded = manifest.models[role].source_sha256
        if recorded and not _same_checkpoint(source, recorded):
            raise ExportError(changed_message(role, source))


def _rebuild_with_head(
    root: Path, sources: dict[str, Path], options: ExportOptions, log: Log
) -> Manifest:
    """A bundle drafted for by an EAGLE head, exported anew in place from its target and head:
    their engines go together (the target's computes the head's features), the CPU ones
    always, the cuda ones where asked for."""
    from specrt.export.pipeline import export_bundle

    log(f"exporting the bundle anew from {sources['target']} and its head {sources['draft']}")
    return export_bundle(sources["target"], sources["draft"], root, options, force=True, log=log)


def _same_checkpoint(source: Path, recorded: str) -> bool:
    """Whether ``source`` is still the checkpoint whose hash the manifest recorded (by what its
    config.json says; bundles of earlier versions recorded the file's bytes; a GGUF file by
    its bytes)."""
    if source.is_file():
        return sha256_file(source) == recorded
    return recorded in checkpoint_hashes(source)


def changed_message(role: str, source: Path) -> str:
    return (
        f"the {role} checkpoint at {source} changed since this bundle was exported from it (it "
        "is no longer the model in the bundle), and engines must be built from the bundle's "
        "model: re-export the bundle with `specrt export`"
    )

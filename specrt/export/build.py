"""`specrt build`: (re)build the onnxruntime engines of an existing bundle.

The engines are built from the checkpoints the bundle was exported from (``source`` in the
manifest), after checking that each checkpoint still is the model in the bundle: PyTorch's logits
must match the bundle's portable graph within ``atol``. The new bundle is assembled in a scratch
copy and swapped in only when every engine passed its check; a failure leaves the bundle as it was.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from specrt.bundle import (
    ONNXRUNTIME_ENGINE,
    ROLES,
    Manifest,
    read_manifest,
    verify_checksums,
    write_manifest,
)
from specrt.errors import ExportError
from specrt.export.options import ExportOptions
from specrt.export.pipeline import Log, add_ort_engine, replace_dir, require_close


def build_engines(
    bundle_dir: str | Path, options: ExportOptions | None = None, log: Log = lambda message: None
) -> Manifest:
    """``options``: the engines' (``draft_precision``) and the check's (``atol``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specrt.export.numeric_check import max_logit_difference

    options = options or ExportOptions()
    root = Path(bundle_dir)
    manifest = read_manifest(root)
    verify_checksums(manifest, root)
    sources = {role: Path(manifest.models[role].source) for role in ROLES}
    for role, source in sources.items():
        if not (source / "config.json").is_file():
            raise ExportError(
                f"the {role} checkpoint this bundle was exported from ({source}) is gone; "
                "engines are built from it: re-export with `specrt export`"
            )

    scratch = Path(tempfile.mkdtemp(prefix=f".{root.name}.build-", dir=root.parent))
    try:
        shutil.rmtree(scratch)
        shutil.copytree(root, scratch)
        for role in ROLES:
            spec = manifest.models[role]
            old = spec.engines.pop(ONNXRUNTIME_ENGINE, None)
            if old is not None:
                shutil.rmtree((scratch / old.path).parent, ignore_errors=True)
            model = AutoModelForCausalLM.from_pretrained(
                sources[role], dtype=torch.float32, local_files_only=True
            ).eval()
            same = max_logit_difference(model, scratch / spec.path, spec, manifest.vocab_size)
            what = f"{role} (checkpoint vs the bundle's graph)"
            require_close(same, options.atol, what, sources[role])
            config = AutoConfig.from_pretrained(sources[role], local_files_only=True)
            log(f"building the {role} onnxruntime engine from {sources[role]}")
            add_ort_engine(model, spec, config, scratch, role, manifest.vocab_size, options, log)
            for name, engine in spec.engines.items():
                diff = engine.export_check["max_abs_logit_diff"]
                log(f"  {role} {name} engine, {engine.precision}: max |logit diff| {diff:.2e}")
        write_manifest(scratch, manifest)
        replace_dir(scratch, root)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return manifest

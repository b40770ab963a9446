"""What decides the model an engine is built from: one hash over a checkpoint's config and
weights, recorded in the manifest at export and compared by `specrt build`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from specrt.checksums import sha256_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def checkpoint_sha256(checkpoint: Path) -> str:
    """One hash over a checkpoint's config and weight files (names and contents): what decides
    the model an engine is built from. config.json counts by what it says (its parsed JSON, less
    the transformers version that saved it), not by its layout: re-indenting it changes no
    model."""
    return checkpoint_hashes(checkpoint)[0]


def checkpoint_hashes(checkpoint: Path) -> tuple[str, str]:
    """`checkpoint_sha256`, and the hash earlier versions recorded (config.json's bytes), the
    weights read once for both."""
    names = sorted(
        p.name
        for p in checkpoint.iterdir()
        if p.is_file() and (p.name == "config.json" or p.name.endswith(WEIGHT_SUFFIXES))
    )
    as_written = {name: sha256_file(checkpoint / name) for name in names}
    as_said = dict(as_written)
    said = "config.json" in names and _config_sha256(checkpoint / "config.json")
    if said:
        as_said["config.json"] = said
    return _combined(as_said), _combined(as_written)


def _combined(files: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name, sha256 in sorted(files.items()):
        digest.update(f"{name}\0{sha256}\n".encode())
    return digest.hexdigest()


def _config_sha256(path: Path) -> str | None:
    """The hash of what a config.json says; None where it is not a JSON object (its bytes then
    stand for it, and reading it as a config fails later with its own message)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(config, dict):
        return None
    config.pop("transformers_version", None)  # which release saved it, not the model
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()

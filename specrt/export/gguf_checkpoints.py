"""GGUF checkpoints (llama.cpp's format) read as Hugging Face ones.

transformers reads a GGUF file (its weights dequantised to float32, its tokenizer and chat
template) into a model; that is saved as a Hugging Face folder in a staging directory beside the
bundle, and the export goes on from there as from any checkpoint. The bundle's model is the
GGUF's own weights, dequantised: what llama.cpp runs on the same file, up to its arithmetic. The
manifest names the GGUF file and its hash, so `specrt build` finds it again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from specrt.errors import ExportError
from specrt.staging import staging

SUFFIX = ".gguf"


def gguf_file(path: Path, role: str) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one in a folder that has no
    config.json; None for anything else (a Hugging Face folder)."""
    if path.is_file() and path.name.lower().endswith(SUFFIX):
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.name.lower().endswith(SUFFIX) and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4])
        raise ExportError(
            f"{role} folder {str(path)!r} holds {len(found)} GGUF files ({names}); pass the one "
            f"to export: --{role} {found[0]}"
        )
    return found[0] if found else None


@contextlib.contextmanager
def as_folders(
    sources: dict[str, Path], ggufs: dict[str, Path], out: Path, log: Callable[[str], None]
) -> Iterator[dict[str, Path]]:
    """``sources`` (role -> checkpoint) with those of ``ggufs`` (role -> its GGUF file)
    replaced by Hugging Face folders converted from them, in a staging directory beside ``out``
    removed on the way out."""
    if not ggufs:
        yield sources
        return
    with staging(out, "gguf") as converted:
        folders = dict(sources)
        for role, found in ggufs.items():
            log(f"reading the {role} GGUF file {found}")
            folders[role] = convert(found, converted / role, role)
        yield folders


def convert(gguf: Path, dest: Path, role: str) -> Path:
    """Write the GGUF file's model (float32) and tokenizer as a Hugging Face folder ``dest``."""
    try:
        import gguf as _  # noqa: F401  (transformers' reader needs it)
    except ImportError:
        raise ExportError(
            "reading a GGUF checkpoint needs the gguf package: pip install 'specrt[export]'"
        ) from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    damaged = _damage(gguf)
    if damaged:
        raise ExportError(
            f"{role} GGUF file {str(gguf)!r} is truncated or damaged ({damaged}); copy or "
            "download it again"
        )
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name, local_files_only=True
        )
    except Exception as exc:  # transformers' reader and converters fail in many ways on a file
        # they do not take (a BPE tokenizer without its merges: AttributeError)
        raise ExportError(
            f"{role} GGUF file {str(gguf)!r} cannot be read ({type(exc).__name__}: "
            f"{str(exc)[:200]}); export a GGUF of a supported architecture, or its Hugging "
            "Face checkpoint"
        ) from exc
    finally:
        transformers_logging.set_verbosity(verbosity)
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def _damage(gguf: Path) -> str | None:
    """Why the file is not a whole GGUF file (a copy cut short, another format), or None. The
    gguf package maps it without reading the tensors, so this costs milliseconds; transformers'
    reader said only "cannot reshape array" of a file cut short."""
    from gguf import GGUFReader

    try:
        GGUFReader(gguf)
    except Exception as exc:  # the reader's own checks: magic, version, each tensor's extent
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None

"""Verified file hashes, remembered: loading a bundle hashes every file once, not on every load.

A file's sha256 is kept with its identity (device, inode, size, modification and change times in
ns). Any write to the file changes its change time, which no user can set back, so a file whose
identity is unchanged still has the remembered hash. The memory is per process and, best effort,
on disk (``$SPECRT_CACHE_DIR``, else ``$XDG_CACHE_HOME/specrt`` or ``~/.cache/specrt``), so
services that restart and CLI calls load multi-GB bundles without re-reading them.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from specrt import json_text
from specrt.errors import BundleError

if TYPE_CHECKING:
    from specrt.bundle import Manifest

CACHE_FILE = "verified-files.json"
MAX_ENTRIES = 10_000
_memory: dict[str, tuple[list[int], str]] = {}
_lock = threading.Lock()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def cached_sha256(path: str | Path) -> str:
    """``sha256_file(path)``, from memory when the file is the one hashed before."""
    key = os.path.realpath(path)
    identity = _identity(key)
    with _lock:
        if not _memory:
            _memory.update(_load())
        remembered = _memory.get(key)
    if remembered is not None and remembered[0] == identity:
        return remembered[1]
    digest = sha256_file(key)
    if _identity(key) == identity:  # unchanged while it was read
        with _lock:
            _memory[key] = (identity, digest)
            _save(_memory)
    return digest


def _identity(path: str) -> list[int]:
    stat = os.stat(path)
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def cache_dir() -> Path:
    if os.environ.get("SPECRT_CACHE_DIR"):
        return Path(os.environ["SPECRT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specrt"


def _trusted(directory: Path) -> bool:
    """Whether only this user can have written the memory: a folder someone else owns, or
    that others may write in, could vouch for a changed file."""
    try:
        folder, memory = directory.stat(), (directory / CACHE_FILE).stat()
    except OSError:
        return False
    return all(
        entry.st_uid == os.getuid() and not entry.st_mode & 0o022 for entry in (folder, memory)
    )


def _load() -> dict[str, tuple[list[int], str]]:
    if not _trusted(cache_dir()):
        return {}  # hash again rather than believe it
    try:
        data = json_text.loads((cache_dir() / CACHE_FILE).read_text())
        return {key: (list(entry[0]), str(entry[1])) for key, entry in data.items()}
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return {}  # no memory yet, or an unreadable one: hash again


def _save(entries: dict[str, tuple[list[int], str]]) -> None:
    """Write the memory atomically, with what other processes saved since this one read it
    (theirs would be lost else, and hashed again); a read-only or full disk only costs
    re-hashing later, and leaves no temporary file behind."""
    for key, entry in _load().items():
        entries.setdefault(key, entry)
    if len(entries) > MAX_ENTRIES:
        for key in list(entries)[: len(entries) - MAX_ENTRIES]:
            del entries[key]
    directory = cache_dir()
    scratch = directory / f".{CACHE_FILE}.{os.getpid()}.{threading.get_ident()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        scratch.write_text(json.dumps(entries))
        os.replace(scratch, directory / CACHE_FILE)
    except OSError:
        try:
            scratch.unlink(missing_ok=True)
        except OSError:
            pass


def verify_checksums(manifest: Manifest, root: str | Path) -> None:
    """Hash every model file and the tokenizer against the manifest (a file hashed before and
    unchanged since is not read again)."""
    from specrt.bundle import ROLES

    root = Path(root)
    for role in ROLES:
        for rel, expected in manifest.models[role].all_files().items():
            actual = cached_sha256(root / rel)
            if actual != expected:
                raise BundleError(
                    f"{role}: {rel} does not match its sha256 in the manifest (the file changed "
                    "or is corrupted); re-export or re-copy the bundle"
                )
    tok = root / manifest.tokenizer.path / "tokenizer.json"
    if cached_sha256(tok) != manifest.tokenizer.sha256:
        raise BundleError(
            f"{tok} does not match its sha256 in the manifest; re-export or re-copy the bundle"
        )


VOCAB_FILE = "vocab.sha256"  # beside token ids saved for a tokenizer: `vocab_fingerprint`


def vocab_fingerprint(vocab: Mapping[str, int]) -> str:
    """What tells token ids of one tokenizer from another's: its vocabulary (added tokens
    included), hashed. transformers' ``get_vocab()`` gives the same for the same tokenizer, so
    token ids saved by `specrt distill` can be matched to a bundle's."""
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]

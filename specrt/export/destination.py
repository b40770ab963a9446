"""Where an export writes: a destination checked before any work (never a source checkpoint,
the working directory or a folder that is not a bundle; a link followed), and the files a user
put in the bundle it replaces, carried over into the new one."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from specrt.bundle import (
    CORPUS_FILE,
    MANIFEST_NAME,
    is_bundle,
)
from specrt.errors import ExportError
from specrt.export.checkpoints import (
    TOKENIZER_FILES,
)
from specrt.staging import keep_others, recover, through_links


def check_destination(
    out: Path,
    sources: list[Path],
    force: bool,
    ours: Callable[[Path], bool] = is_bundle,
    what: tuple[str, str] = ("a bundle", MANIFEST_NAME),
) -> None:
    """Refuse an ``out`` whose replacement could lose anything: only a folder specrt wrote
    (``ours``: a bundle, by default) may be replaced (with ``force``), and never one holding a
    source or the working directory (``what``: what it is called, and the file that marks
    it). A symbolic link to such a folder is followed: the folder
    it points to is replaced, and the link stays (`specrt.staging.through_links`)."""
    above = next((p for p in out.parents if os.path.lexists(p)), None)
    if above is not None and not above.is_dir():
        raise ExportError(f"--out {out}: {above} is a file, not a folder; choose another --out")
    real = through_links(out)
    recover(real)
    for source in sources:
        if _holds(out, source):
            raise ExportError(
                f"--out {out} is or holds the source checkpoint {source}; writing the bundle "
                "there would replace it: choose another --out"
            )
    if _holds(out, Path.cwd()):
        raise ExportError(
            f"--out {out} is or holds the current directory; give the path of the bundle "
            "directory to write, e.g. engines/mypair"
        )
    if not os.path.lexists(real):
        return
    refuse_mount_point(out)
    if not real.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory; choose another --out")
    if not any(real.iterdir()):
        return
    noun, mark = what
    if not ours(real):
        raise ExportError(
            f"--out {out} exists and is not {noun} specrt wrote (no {mark}); specrt replaces "
            "only what it wrote: choose another --out or empty it yourself"
        )
    if not force:
        raise ExportError(f"{out} already exists and holds {noun}; pass --force to replace it")


def refuse_mount_point(out: Path, option: str = "--out") -> None:
    """A mount point cannot be renamed, so a bundle staged beside it cannot be swapped in
    (`specrt.staging.publish`): said before the work, not as "Device or resource busy" after."""
    real = through_links(out)
    if real.is_dir() and os.path.ismount(real):
        raise ExportError(
            f"{option} {out} is a mount point, which specrt cannot swap a new bundle into (it "
            f"writes one beside it, then renames it): give a folder inside it, e.g. {out}/bundle"
        )


def _holds(out: Path, path: Path) -> bool:
    """Whether ``path`` is ``out`` or inside it, as written or through symbolic links."""
    paths = (os.path.abspath, os.path.realpath)
    return any(Path(where(path)).is_relative_to(where(out)) for where in paths)


def keep_users_files(
    out: Path, staged: Path, log: Callable[[str], None] = lambda message: None
) -> list[Path]:
    """Carry into the ``staged`` bundle the files a user put in the bundle at ``out`` that it
    replaces (notes, a licence): replacing a bundle replaces what specrt wrote, not theirs.
    Returns them, relative; refuses, naming it, one the new bundle would overwrite."""
    old = through_links(out)
    if not is_bundle(old):
        return []
    ours = written_by_specrt(old)
    corpus = Path(CORPUS_FILE)  # `specrt corpus`'s: kept where its token ids still hold
    if (old / corpus).is_file() and _tokenizer(old) != _tokenizer(staged):
        ours.add(corpus)
        log(f"  left out {out / corpus}: built for the old tokenizer; build it again with "
            f"`specrt corpus --bundle {out} ...`")  # fmt: skip
    try:
        kept = keep_others(old, staged, lambda rel: rel in ours or _specrt_cache(rel))
    except FileExistsError as exc:
        raise ExportError(
            f"{old / exc.filename} is not part of the bundle (its manifest does not name it) "
            f"and the new bundle writes a file there: move it out of {out} and export again "
            "(the bundle is left as it was)"
        ) from exc
    if corpus in kept:
        log(f"  kept its corpus ({corpus}): the new bundle has the same tokenizer")
    users = [rel for rel in kept if rel != corpus]
    if users:
        shown = ", ".join(str(rel) for rel in users[:3]) + (", ..." if len(users) > 3 else "")
        log(f"  kept {len(users)} file(s) in {out} that specrt did not write: {shown}")
    return kept


def _tokenizer(bundle: Path) -> object:
    """The tokenizer hash a bundle's manifest records (read loosely: any version)."""
    try:
        data = json.loads((bundle / MANIFEST_NAME).read_text())
        return data["tokenizer"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def written_by_specrt(bundle: Path) -> set[Path]:
    """The files of an existing bundle that specrt wrote: its manifest, every file it names
    (graphs, weights, engines) and the tokenizer files taken from a checkpoint. The manifest
    is read loosely: a bundle of any version is understood."""
    data = json.loads((bundle / MANIFEST_NAME).read_text())
    ours = {Path(MANIFEST_NAME)}
    models = data.get("models")
    for spec in models.values() if isinstance(models, dict) else ():
        engines = spec.get("engines") if isinstance(spec, dict) else None
        for graph in [spec, *(engines.values() if isinstance(engines, dict) else ())]:
            files = graph.get("files") if isinstance(graph, dict) else None
            if isinstance(files, dict):
                ours.update(map(Path, files))
    tokenizer = data.get("tokenizer")
    folder = tokenizer.get("path") if isinstance(tokenizer, dict) else None
    folder = folder if isinstance(folder, str) and folder else "tokenizer"
    ours.update(Path(folder) / name for name in TOKENIZER_FILES)
    return ours


def _specrt_cache(rel: Path) -> bool:
    """Whether ``rel`` is in what specrt keeps beside a model's graphs: the TensorRT
    provider's engine cache (built for the old graphs, of no use to new ones)."""
    from specrt.backends.tensorrt import EP_CACHE

    return rel.parts[1:2] == (EP_CACHE,)

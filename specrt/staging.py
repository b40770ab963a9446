"""Writing a bundle without ever losing one: build it in a staging directory next to it, then swap.

* `staging(out, kind)`: a fresh ``.NAME.KIND-PID-XXXX`` directory beside ``out``, removed when
  done; the writer's process id is in its name, so the leftovers of a killed run (and only
  those: our naming, a writer that is gone) are removed by the next export or build of that
  bundle. A folder of the user's that merely looks alike is never touched.
* `publish(staged, out)`: put the staged bundle at ``out``. On Linux the two directories are
  exchanged in one atomic rename (``renameat2(RENAME_EXCHANGE)``): ``out`` holds the old bundle
  or the new one at every instant. Elsewhere the old one is parked at ``.NAME.specrt-old``
  (marked as parked first) for the two renames; if the process dies between them, `recover`
  moves it back on the next load or write.
* Directories and files follow the umask, as any other tool's output would (a temporary
  directory is private by default, and a service account must be able to read the bundle).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import os
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

OWNER_FILE = ".specrt-writer"  # in a staging directory: the pid of the process writing it
PARKED_FILE = ".specrt-parked"  # in a bundle parked by `publish`: it is ours to move or remove
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def through_links(out: Path) -> Path:
    """Where a bundle at ``out`` really is: a symbolic link (engines/demo -> a bundle kept
    elsewhere) is the user's and stays; the bundle it points to is the one replaced."""
    return Path(os.path.realpath(out)) if os.path.islink(out) else out


def parked(out: Path) -> Path:
    return out.parent / f".{out.name}.specrt-old"


def _is_parked(old: Path) -> bool:
    """Whether ``old`` is a bundle `publish` parked (a folder of that name without its mark is
    the user's, and stays)."""
    return old.is_dir() and not old.is_symlink() and (old / PARKED_FILE).is_file()


def recover(out: Path) -> bool:
    """Move a bundle parked by an interrupted `publish` back to ``out``; True if it did."""
    old = parked(out)
    if not os.path.lexists(out) and _is_parked(old) and (old / "manifest.json").is_file():
        os.replace(old, out)
        (out / PARKED_FILE).unlink(missing_ok=True)
        return True
    return False


@contextlib.contextmanager
def staging(out: Path, kind: str) -> Iterator[Path]:
    """A new staging directory for ``out`` (``kind``: "partial" for an export, "build" for a
    rebuild, "gguf" for checkpoints read from GGUF files), removed on the way out whatever
    happens; stale ones of dead writers go first."""
    out = through_links(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    prefix = f".{out.name}.{kind}-{os.getpid()}-"  # the writer in the name: no unmarked instant
    directory = None
    try:  # made inside: a signal (SIGTERM, Ctrl-C) right after it is made still removes it
        try:
            directory = Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
        except OSError as exc:  # named by the path asked for, not by a staging name never made
            raise OSError(exc.errno, exc.strerror, str(out)) from exc
        (directory / OWNER_FILE).write_text(str(os.getpid()))
        yield directory
    finally:
        made = [directory] if directory else out.parent.glob(glob.escape(prefix) + "*")
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def remove_stale(out: Path) -> list[Path]:
    """Remove staging directories of ``out`` whose writer is gone, and an old bundle parked by
    a swap that was killed after it had put the new one in place; return them. Only what
    specrt made: a staging directory by its name (the writer's pid in it) or, from earlier
    versions, by its writer's marker; a parked bundle by its mark."""
    removed = []
    recover(out)
    old = parked(out)
    if os.path.lexists(out) and (_is_parked(old) or _empty_directory(old)):
        _remove_parked(old)  # (empty: killed between the mark's removal and its own)
        removed.append(old)
    for kind in ("partial", "build", "gguf"):
        for candidate in out.parent.glob(f".{out.name}.{kind}-*"):
            if candidate.is_dir() and not candidate.is_symlink():
                writer = _writer(candidate, f".{out.name}.{kind}-")
                if writer is not None and not _alive(writer):
                    shutil.rmtree(candidate, ignore_errors=True)
                    removed.append(candidate)
    return removed


def _writer(directory: Path, prefix: str) -> int | None:
    """The process id of the writer of a staging directory; None: not one of ours."""
    pid, _, rest = directory.name.removeprefix(prefix).partition("-")
    if pid.isdigit() and rest:
        return int(pid)
    try:  # made by an earlier version: the marker inside
        return int((directory / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def publish(staged: Path, out: Path, kept: Collection[Path] = ()) -> None:
    """Make ``staged`` the bundle at ``out``; the old bundle, if any, is removed after.
    ``kept``: files in ``staged`` (relative) that are the user's, carried over from the old
    bundle (`keep_others`): their modes stay theirs."""
    out = through_links(out)
    (staged / OWNER_FILE).unlink(missing_ok=True)
    follow_umask(staged, kept)
    if not os.path.lexists(out):
        os.replace(staged, out)
        return
    if _exchange(staged, out):
        shutil.rmtree(staged, ignore_errors=True)  # it now holds the old bundle
        return
    old = parked(out)
    if _is_parked(old):
        _remove_parked(old)
    elif os.path.lexists(old):
        raise FileExistsError(errno.EEXIST, "in the way of replacing the bundle; move it", str(old))
    (out / PARKED_FILE).write_text(str(os.getpid()))  # before the move: never parked unmarked
    os.replace(out, old)
    try:
        os.replace(staged, out)
    except BaseException:
        os.replace(old, out)  # interrupted or failed: the old bundle stays where it was
        (out / PARKED_FILE).unlink(missing_ok=True)
        raise
    _remove_parked(old)


def _empty_directory(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def _remove_parked(old: Path) -> None:
    """Remove a parked bundle, its mark last: one killed halfway is still known as ours."""
    for entry in old.iterdir():
        if entry.name == PARKED_FILE:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    shutil.rmtree(old, ignore_errors=True)


def follow_umask(root: Path, kept: Collection[Path] = ()) -> None:
    """Give ``root`` and everything in it the modes the umask gives new files and directories,
    but for the files ``kept`` (relative to ``root``: the user's, whose modes are theirs)."""
    umask = current_umask()
    theirs = {os.path.join(root, rel) for rel in kept}
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o777 & ~umask)
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path) and path not in theirs:
                os.chmod(path, 0o666 & ~umask)


def keep_others(old: Path, staged: Path, ours: Callable[[Path], bool]) -> list[Path]:
    """Carry into ``staged`` every file (or symbolic link) of the bundle ``old`` that
    ``ours`` says specrt did not write, at the same place: replacing a bundle replaces what
    specrt wrote, never what a user put in it. Hard links where the file system allows (no
    copy of a large file, its mode and owner kept), copies elsewhere. Returns the paths kept,
    relative; raises FileExistsError where the new bundle has a file at one of them."""
    kept = []
    for directory, folders, files in os.walk(old):
        links = [name for name in folders if os.path.islink(os.path.join(directory, name))]
        for name in sorted(files + links):
            rel = Path(directory, name).relative_to(old)
            if ours(rel):
                continue
            target = staged / rel
            if os.path.lexists(target) or _a_file_above(target, staged):
                raise FileExistsError(errno.EEXIST, "the new bundle writes a file there", str(rel))
            target.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(old / rel, target)
            kept.append(rel)
    return kept


def _a_file_above(path: Path, root: Path) -> bool:
    """Whether a folder that ``path`` needs below ``root`` is a file (or a link) there."""
    above = path.parent
    while above != root:
        if os.path.lexists(above) and (above.is_symlink() or not above.is_dir()):
            return True
        above = above.parent
    return False


def _link_or_copy(source: Path, target: Path) -> None:
    if source.is_symlink():  # the link itself, pointing where it pointed
        os.symlink(os.readlink(source), target)
        return
    try:
        os.link(source, target)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(source, target)


def current_umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux): setting
    it to read it back would race with other threads creating files."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the system or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(b))

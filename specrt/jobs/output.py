"""A batch job's output file: the ids already done (a torn last line cut, a line emptied
by hand run again), what is ours and what is not, and the lock that keeps it the job's own."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import IO

from specrt.errors import InvalidInputError, unwritable_reason
from specrt.jobs import openai_batch


def done_ids(output: Path, output_format: str = "specrt", mend: bool = True) -> dict[str, bool]:
    """Ids already in ``output``, each with whether its record is an error, read line by line
    (a million-row job's output need not fit in memory). A last line without its newline that
    begins as every record does but is not one whole (a crash mid-write) is cut off, and its
    row runs again; a whole record without its newline is kept and ended. Any
    other line that is not a result record means the file is not ours: it is refused and
    left as it is, as is a file of records in the other ``output_format``. A pipe or a
    device (stdout, /dev/null) cannot be read back: nothing is done. ``mend=False``: the
    file is only read."""
    if not output.is_file():
        return {}
    ids, kept, torn, unended = {}, 0, False, False
    with open(output, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():  # a record's line emptied by hand: its row runs again
                kept += len(line)
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                record = None
            if not line.endswith(b"\n"):  # the last line, without its newline
                if record is None and (
                    line.startswith(RECORD_START) or RECORD_START.startswith(line)
                ):
                    torn = True
                    break
                unended = True  # whole but for its newline (kept, ended), or not ours
            if is_result(record) and output_format == "specrt":
                ids[str(record["id"])] = "error" in record
            elif openai_batch.is_record(record) and output_format == "openai":
                ids[str(record["custom_id"])] = openai_batch.failed(record)
            elif is_result(record) or openai_batch.is_record(record):
                raise _other_format(output, number, output_format)
            else:
                raise _not_ours(output, number)
            kept += len(line)
    if torn and mend:
        with open(output, "r+b") as handle:
            handle.truncate(kept)
    elif unended and mend:
        with open(output, "ab") as handle:
            handle.write(b"\n")
    return ids


# How every line `run_batch` writes begins (`json.dumps` of a record whose first key is "id").
RECORD_START = b'{"id": '
RESULT_KEYS = {"text", "token_ids", "finish_reason", "stats"}


def is_result(record: object) -> bool:
    """Whether ``record`` is a line `run_batch` writes: a result or a row's error."""
    if not isinstance(record, dict) or "id" not in record:
        return False
    if "error" in record:
        return set(record) == {"id", "error"} and isinstance(record["error"], dict)
    return RESULT_KEYS <= set(record)


def _other_format(output: Path, line: int, output_format: str) -> InvalidInputError:
    other = "specrt" if output_format == "openai" else "openai"
    name = "standard output (--output -)" if str(output) == "/dev/stdout" else str(output)
    return InvalidInputError(
        f"{name} holds records of --output-format {other} (line {line}), not {output_format}: "
        f"rerun with --output-format {other} to go on with it, or give another --output"
    )


def _not_ours(output: Path, line: int) -> InvalidInputError:
    if str(output) == "/dev/stdout":  # --output - into a file (`>> out.jsonl`): resumed too
        return InvalidInputError(
            f"standard output (--output -) is a file whose line {line} is not a result of "
            "specrt batch; send it elsewhere (the file is left as it is)"
        )
    return InvalidInputError(
        f"{output} line {line} is not a result of specrt batch; give another --output (this "
        "one is left as it is)"
    )


def _lock(out: IO, output_path: Path) -> None:
    """Hold the output for this job alone (the kernel lets go when the process ends, however
    it ends): a second job on it, a rerun started while the first still runs, would run the
    rows left again and write them twice."""
    if not output_path.is_file():  # a pipe or a device: nothing to resume, nothing to share
        return
    try:
        fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        name = "standard output" if str(output_path) == "/dev/stdout" else str(output_path)
        raise InvalidInputError(
            f"another specrt batch is writing {name}; wait for it to finish (or stop it), then "
            "run this again to go on from where it is"
        ) from exc


def output_paths(
    input_path: Path, output_path: Path, summary: Path | None
) -> tuple[Path, Path | None]:
    """``--output`` and ``--summary`` as the job writes them ("-": standard output, a link to
    nothing yet followed), refused before any work where the job could not write them at its
    end or where they are the input or each other."""
    to_stdout = str(output_path) == "-"
    if to_stdout:
        output_path = Path("/dev/stdout")
    elif same_file(input_path, output_path):
        raise InvalidInputError("--output must not be the --input file")
    else:
        output_path = through_link(output_path, "--output")
        check_writable(output_path, "--output")
    if summary is not None and str(summary) == "-":
        if to_stdout:
            raise InvalidInputError("--output - and --summary - would both go to stdout")
        summary = Path("/dev/stdout")
    elif summary is not None:
        if same_file(summary, input_path) or same_file(summary, output_path):
            raise InvalidInputError("--summary must not be the --input or the --output file")
        summary = through_link(summary, "--summary")
        check_writable(summary, "--summary")
    return output_path, summary


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (the same path, a symbolic or a hard link)."""
    try:
        return a.resolve() == b.resolve() or os.path.samefile(a, b)
    except (OSError, RuntimeError):  # one of them does not exist (yet), or loops
        return False


def through_link(path: Path, option: str) -> Path:
    """Where a symbolic link to nothing yet points (missing folders on the way are made there,
    not beside the link); any other path as it is (opening it follows a live link, such as
    /dev/stdout to a pipe, which has no path of its own)."""
    if path.is_symlink() and not path.exists():
        try:
            os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise InvalidInputError(f"{option} {path} is a loop of symbolic links") from exc
        return Path(os.path.realpath(path))
    return path


def check_writable(path: Path, option: str) -> None:
    """Refuse, before any work, a file the job could not write at its end: a directory, one
    under a file, or where writing is not allowed."""
    if path.is_dir():
        raise InvalidInputError(f"{option} {path} is a directory; give a file")
    if path.exists():
        if not os.access(path, os.W_OK):
            why = unwritable_reason(path)
            raise InvalidInputError(f"{option} {path} cannot be written ({why})")
        return
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise InvalidInputError(f"{option} {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        why = unwritable_reason(folder)
        raise InvalidInputError(f"{option} {path}: cannot write in {folder} ({why})")
    try:  # os.access says yes to root everywhere (/proc, /sys): a nameless file says for sure
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise InvalidInputError(f"{option} {path}: cannot write in {folder} ({why})") from None

"""`specrt` and `python -m specrt`: the command line. Ctrl-C during its imports (numpy and
onnxruntime take a second or two) ends as it does later, in one line, not a traceback."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from specrt.cli import main as cli
    except (KeyboardInterrupt, ImportError) as exc:
        # onnxruntime's extension turns a Ctrl-C in its start-up into "initialization failed"
        if not _interrupted(exc):
            raise
        sys.stderr.write("\ninterrupted (Ctrl-C)\n")
        sys.exit(130)
    cli()


def _interrupted(exc: BaseException | None) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


if __name__ == "__main__":
    main()

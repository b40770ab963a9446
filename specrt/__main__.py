"""`specrt` and `python -m specrt`: the command line. Ctrl-C during its imports (numpy and
onnxruntime take a second or two) ends as it does later, in one line, not a traceback."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from specrt.cli import main as cli
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted (Ctrl-C)\n")
        sys.exit(130)
    cli()


if __name__ == "__main__":
    main()

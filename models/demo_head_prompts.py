"""The prompts the demo target answers to train its EAGLE-3 head (`make demo-head`): a function's
``def`` line and the lines before it, from the standard library files the demo pair was trained
on (never its held-out files, nor the click source the benchmarks use).

    .venv/bin/python models/demo_head_prompts.py > models/demo/head_train_prompts.jsonl
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import sysconfig
from pathlib import Path

HELDOUT_EVERY = 50  # as models/train_demo.py: a file is held out when hash(path) % 50 == 0
PER_FILE = 4
CONTEXT_LINES = 8


def prompts(count: int = 2000) -> list[dict]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[dict] = []
    for path in sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts):
        rel = path.relative_to(root).as_posix()
        if int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0:
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        defs = [i for i, line in enumerate(lines) if re.match(r"\s*def \w+\(.*\):\s*$", line)]
        for i in defs[1 : 1 + PER_FILE]:
            text = "".join(lines[max(0, i - CONTEXT_LINES) : i + 1])[-600:]
            found.append({"file": rel, "line": i + 1, "prompt": text})
    step = max(1, len(found) // count)  # spread over the library, not its first packages
    return found[::step][:count]


if __name__ == "__main__":
    for item in prompts():
        sys.stdout.write(json.dumps(item) + "\n")

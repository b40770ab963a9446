"""The prompts the demo target answers to train its EAGLE-3 head (`make demo-head`): a function's
``def`` line and the lines before it, from the standard library files the demo pair was trained
on (never its held-out files), then from the Python packages specrt's extras install (never
click, whose source the benchmarks use as text neither model saw).

The packages' prompts teach the head how the target goes on from code it was not trained on,
which is what users send it; their source moves with their versions, so the committed
``models/demo/head_train_prompts.jsonl`` is the set the shipped head learned from.

    .venv/bin/python models/demo_head_prompts.py > models/demo/head_train_prompts.jsonl
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
import sysconfig
from pathlib import Path

HELDOUT_EVERY = 50  # as models/train_demo.py: a file is held out when hash(path) % 50 == 0
PER_FILE = 4
CONTEXT_LINES = 8
# Installed with specrt's extras (export, ray, serve); click is the benchmarks' held-out text.
PACKAGES = (
    "numpy", "onnx", "transformers", "torch", "ray", "tqdm", "prometheus_client", "starlette",
    "optimum", "onnxruntime",
)  # fmt: skip


def def_prompts(root: Path, prefix: str = "", skip=lambda rel: False) -> list[dict]:
    """Up to `PER_FILE` prompts from each ``.py`` file under ``root``: a ``def`` line (not a
    file's first) and the `CONTEXT_LINES` before it."""
    found: list[dict] = []
    for path in sorted(root.rglob("*.py")):
        rel = prefix + path.relative_to(root).as_posix()
        if "site-packages" in path.relative_to(root).parts or skip(rel):
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        defs = [i for i, line in enumerate(lines) if re.match(r"\s*def \w+\(.*\):\s*$", line)]
        for i in defs[1 : 1 + PER_FILE]:
            text = "".join(lines[max(0, i - CONTEXT_LINES) : i + 1])[-600:]
            found.append({"file": rel, "line": i + 1, "prompt": text})
    return found


def spread(found: list[dict], count: int) -> list[dict]:
    """``count`` of ``found``, evenly spread over it (not its first packages)."""
    step = max(1, len(found) // count)
    return found[::step][:count]


def held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def prompts(count: int = 2000, package_count: int = 4000) -> list[dict]:
    stdlib = def_prompts(Path(sysconfig.get_paths()["stdlib"]), skip=held_out)
    packages: list[dict] = []
    for name in PACKAGES:
        root = Path(next(iter(importlib.util.find_spec(name).submodule_search_locations)))
        packages += def_prompts(root, prefix=f"{name}/")
    return spread(stdlib, count) + spread(packages, package_count)


if __name__ == "__main__":
    for item in prompts():
        sys.stdout.write(json.dumps(item) + "\n")

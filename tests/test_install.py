"""Running bundles needs no export stack: `pip install -e '.[serve]'` from a clone brings numpy,
onnxruntime, tokenizers and the server, no torch, and generate, batch and serve run with torch,
transformers, optimum and onnx unimportable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXPORT_STACK = ("torch", "transformers", "optimum", "optimum-onnx", "onnx", "onnxslim")
# Makes the export stack unimportable in a child process (a sitecustomize on its path).
BLOCKER = """
import importlib.abc, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "transformers", "optimum", "onnx", "onnxslim"}:
            raise ImportError(f"{name} is not installed (blocked by the test)")
        return None

sys.meta_path.insert(0, Blocked())
"""


def test_the_runtime_and_serve_install_pulls_no_export_stack(tmp_path):
    """What pip would install for the README's runtime-only line, resolved against the package
    index (a few seconds; skipped where the index cannot be reached)."""
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
         "--report", str(report), f"{REPO}[serve]"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode and any(
        word in done.stderr
        for word in ("NewConnectionError", "Network is unreachable", "timed out")
    ):
        pytest.skip(f"the package index cannot be reached: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert {"numpy", "onnxruntime", "tokenizers", "starlette", "uvicorn"} <= names
    assert not names & set(EXPORT_STACK), names & set(EXPORT_STACK)


def test_bundles_run_without_the_export_stack(llama_bundle, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": f"{blocker}{os.pathsep}{REPO}"}
    probe = [sys.executable, "-c", "import torch"]
    assert subprocess.run(probe, env=env, capture_output=True).returncode == 1  # it blocks
    cli = [sys.executable, "-m", "specrt.cli"]
    generate = [*cli, "generate", "--bundle", str(llama_bundle), "--prompt", "def f"]
    done = subprocess.run(
        [*generate, "--max-new-tokens", "4", "--threads", "1"], env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": 1, "prompt": "def f"}\n')
    batch = [*cli, "batch", "--bundle", str(llama_bundle), "--input", str(rows), "--output"]
    done = subprocess.run(
        [*batch, str(tmp_path / "out.jsonl"), "--max-new-tokens", "4", "--threads", "1"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    serve = [sys.executable, "-c", "import specrt.serve.server, specrt.serve.app"]
    done = subprocess.run(serve, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

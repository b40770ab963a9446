"""The README's quickstart and the scripts of examples/, run exactly as written: each `sh` block
through bash, the server block in the background while the blocks after it run against it, the
Python block as a script; from a folder laid out as a clone after `make demo` (engines/demo,
examples/), with the venv's `specrt` on the PATH."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PORT = 8000  # the README's


def quickstart_blocks() -> list[tuple[str, str]]:
    """The fenced blocks of the README's Quickstart that name a language: (language, code)."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```(sh|python)\n(.*?)^```$", section, re.S | re.M)


@pytest.fixture
def clone(demo_bundle, tmp_path):
    """A folder as a clone has it after `make demo`, and the environment a user's shell has
    after activating the venv."""
    work = tmp_path / "clone"
    work.mkdir()
    (work / "engines").symlink_to(demo_bundle.parent)
    (work / "examples").symlink_to(REPO / "examples")
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env["PYTHONPATH"] = str(REPO)
    return work, env


def run(command: list[str], work: Path, env: dict) -> tuple[str, str]:
    """Its stdout and stderr, once it exited 0."""
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done.stdout, done.stderr


def wait_for_health(server: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stderr.read()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the server did not come up")


def test_the_quickstart_runs_as_written(clone):
    work, env = clone
    blocks = quickstart_blocks()
    assert [language for language, _ in blocks] == ["sh", "sh", "sh", "python"]
    commands, serve, client, python = (code for _, code in blocks)

    out, err = run(["bash", "-e", "-o", "pipefail", "-c", commands], work, env)
    assert "acceptance" in err and "identical output" in err  # --compare's line
    assert "# Write a function that reverses a list.\ndef" in out  # the demo's chat template
    assert len((work / "results.jsonl").read_text().splitlines()) == 2

    assert serve.strip().startswith("specrt serve") and f"--port {PORT}" in serve
    server = subprocess.Popen(
        ["bash", "-c", f"exec {serve.strip()}"], cwd=work, env=env, text=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        wait_for_health(server)
        reply = json.loads(run(["bash", "-e", "-c", client], work, env)[0])
        assert reply["choices"][0]["message"]["role"] == "assistant"
        assert reply["usage"]["completion_tokens"] > 0
        url = f"http://127.0.0.1:{PORT}/v1"
        out, _ = run([sys.executable, "examples/client.py", url], work, env)
        assert len(out.strip().splitlines()) >= 2
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0

    (work / "quickstart.py").write_text(python)
    out, _ = run([sys.executable, "quickstart.py"], work, env)
    assert "tokens per target pass" in out


def test_the_example_scripts_run(clone):
    work, env = clone
    out, _ = run([sys.executable, "examples/generate.py", "engines/demo", "def f(x):"], work, env)
    assert "identical to the target alone: True" in out
    out, _ = run([sys.executable, "examples/batch.py", "engines/demo"], work, env)
    assert len(out.splitlines()) == 4

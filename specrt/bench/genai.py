"""onnxruntime-genai as a contender: its own builder's graphs, its own loop, its own environment.

Its builder needs transformers 5.x (our exporter pins < 4.58), so `bash bench/genai_env.sh` makes
``build/genai-venv`` and builds the pair into ``build/genai``; `specrt bench --genai-python
build/genai-venv/bin/python` then runs ``bench/genai_bench.py`` there as a subprocess on the same
prompts, token count and threads, between specrt's own runs, and merges its medians.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from specrt.errors import SpecrtError

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "genai_bench.py"


def check_genai_environment(python: Path, models: Path) -> None:
    """Fail before any benchmarking when the genai environment or models are missing."""
    if not SCRIPT.is_file():
        raise SpecrtError(f"{SCRIPT} is missing: the genai contender needs a specrt checkout")
    if not Path(python).is_file():
        raise SpecrtError(
            f"--genai-python {python} does not exist; make it with `bash bench/genai_env.sh`"
        )
    if not (Path(models) / "target" / "genai_config.json").is_file():
        raise SpecrtError(
            f"--genai-models {models} has no target/genai_config.json; build it with "
            "`bash bench/genai_env.sh`"
        )


def run_genai(
    python: Path,
    models: Path,
    prompts: Sequence[str],
    max_new_tokens: int,
    threads: int,
    ks: Sequence[int],
    temperature: float,
) -> list[dict]:
    """Run the genai benchmark script; return its contender reports."""
    check_genai_environment(python, models)
    with tempfile.TemporaryDirectory() as scratch:
        prompt_file = Path(scratch) / "prompts.jsonl"
        prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        out = Path(scratch) / "genai.json"
        command = [
            str(python),
            str(SCRIPT),
            "--models",
            str(models),
            "--prompt-file",
            str(prompt_file),
            "--num-prompts",
            str(len(prompts)),
            "--max-new-tokens",
            str(max_new_tokens),
            "--threads",
            str(threads),
            "--num-draft-tokens",
            ",".join(str(k) for k in ks),
            "--temperature",
            str(temperature),
            "--json-out",
            str(out),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not out.is_file():
            raise SpecrtError(
                f"the onnxruntime-genai benchmark failed (exit {done.returncode}):\n"
                f"{done.stderr.strip()[-2000:]}"
            )
        return json.loads(out.read_text())["contenders"]

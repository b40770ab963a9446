"""Prompt files, read one way for the CLI, the benchmarks and the demo scripts.

A ``.jsonl`` file holds one JSON value per line: ``{"prompt": ...}`` or a JSON string (prompts
that span lines); any other file holds one prompt per line. Blank lines are skipped.
This module imports nothing beyond the standard library (the onnxruntime-genai benchmark reads
prompts with it from its own environment).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from specrt.errors import InvalidInputError


def read_prompt_file(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"prompt file {path} does not exist")
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"cannot read prompt file {path}: {exc}") from exc
    if path.suffix != ".jsonl":
        return [line for line in lines if line.strip()]
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{path}:{number} is not JSON ({exc})") from exc
        prompt = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(prompt, str):
            raise InvalidInputError(
                f'{path}:{number} is neither {{"prompt": "..."}} nor a JSON string'
            )
        prompts.append(prompt)
    return prompts


def collect_prompts(
    prompts: Sequence[str] = (), prompt_file: str | Path | None = None
) -> list[str]:
    """Prompts given one by one, then those of ``prompt_file``; at least one."""
    collected = list(prompts)
    if prompt_file is not None:
        collected += read_prompt_file(prompt_file)
    if not collected:
        raise InvalidInputError("give a prompt with --prompt TEXT or --prompt-file FILE")
    return collected

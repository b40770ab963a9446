"""Bundle recipes: ``engines/NAME.json`` says what ``make engines`` builds into ``engines/NAME/``.

    {"target": "../models/demo/target", "draft": "../models/demo/draft", "slim": true}
    {"tiny": {"arch": "llama", "seed": 0}}      # a random-weight pair built from configs

Paths are relative to the recipe file.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from specrt.errors import ExportError
from specrt.export.options import ExportOptions


def resolve_recipe(recipe: Path, out: Path | None = None) -> tuple[Path, Path, Path, dict]:
    """Return (target dir, draft dir, bundle dir, export options) for a recipe file.

    Export options are the recipe's keys named as `ExportOptions` fields (e.g. "slim",
    "draft_precision")."""
    if not recipe.is_file():
        raise ExportError(f"recipe {recipe} does not exist")
    try:
        data = json.loads(recipe.read_text())
    except json.JSONDecodeError as exc:
        raise ExportError(f"recipe {recipe} is not valid JSON ({exc})") from exc
    out = out or recipe.with_suffix("")
    base = recipe.parent
    if isinstance(data, dict) and "tiny" in data:
        from specrt.export.tiny import make_tiny_pair

        target, draft = make_tiny_pair(out_dir=base / f".{out.name}.sources", **data["tiny"])
        return target, draft, out, _options(data)
    if not isinstance(data, dict) or not {"target", "draft"} <= set(data):
        raise ExportError(
            f'recipe {recipe} must be a JSON object with "target" and "draft" paths '
            '(or a "tiny" section)'
        )
    return base / data["target"], base / data["draft"], out, _options(data)


def _options(data: dict) -> dict:
    names = {f.name for f in fields(ExportOptions)}
    return {key: value for key, value in data.items() if key in names}

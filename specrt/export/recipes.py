"""Bundle recipes: ``engines/NAME.json`` says what ``make engines`` builds into ``engines/NAME/``.

    {"target": "../models/demo/target", "draft": "../models/demo/draft", "slim": true}
    {"tiny": {"arch": "llama", "seed": 0}}      # a random-weight pair built from configs

Paths are relative to the recipe file.
"""

from __future__ import annotations

import difflib
import inspect
import json
from dataclasses import fields
from pathlib import Path

from specrt import json_text
from specrt.errors import ExportError
from specrt.export.options import ExportOptions


def resolve_recipe(recipe: Path, out: Path | None = None) -> tuple[Path, Path, Path, dict]:
    """Return (target dir, draft dir, bundle dir, export options) for a recipe file.

    Export options are the recipe's keys named as `ExportOptions` fields (e.g. "slim",
    "draft_precision")."""
    if not recipe.is_file():
        raise ExportError(f"recipe {recipe} does not exist")
    try:
        data = json_text.loads(recipe.read_text(encoding="utf-8-sig"))  # a BOM, as editors write
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExportError(f"recipe {recipe} is not valid JSON in UTF-8 ({exc})") from exc
    out = out or recipe.with_suffix("")
    base = recipe.parent
    if isinstance(data, dict) and "tiny" in data:
        from specrt.export.tiny import make_tiny_pair

        tiny = data["tiny"]
        known = [p for p in inspect.signature(make_tiny_pair).parameters if p != "out_dir"]
        if not isinstance(tiny, dict) or not isinstance(tiny.get("arch"), str):
            raise ExportError(f'recipe {recipe}: "tiny" must be an object with an "arch" name')
        unknown = sorted(set(tiny) - set(known))
        if unknown:
            raise ExportError(f'recipe {recipe}: unknown "tiny" key(s) {unknown}; known: {known}')
        options = _options(recipe, data, {"tiny"})
        try:
            target, draft = make_tiny_pair(out_dir=base / f".{out.name}.sources", **tiny)
        except (TypeError, ValueError, KeyError) as exc:
            raise ExportError(f'recipe {recipe}: its "tiny" section: {exc}') from exc
        return target, draft, out, options
    if isinstance(data, dict) and {"eagle", "draft"} <= set(data):
        raise ExportError(f'recipe {recipe}: give "draft" (a draft model) or "eagle" (an '
                          'EAGLE-3 head), not both')  # fmt: skip
    drafter = "eagle" if isinstance(data, dict) and "eagle" in data else "draft"
    if drafter == "eagle":
        data["draft"] = data.pop("eagle")  # an EAGLE-3 head drafts (found by its config)
    if not isinstance(data, dict) or not {"target", "draft"} <= set(data):
        raise ExportError(
            f'recipe {recipe} must be a JSON object with "target" and "draft" (or "eagle") '
            'paths (or a "tiny" section)'
        )
    if not (isinstance(data["target"], str) and isinstance(data["draft"], str)):
        raise ExportError(f'recipe {recipe}: "target" and "{drafter}" must be paths (strings)')
    options = _options(recipe, data, {"target", "draft"})
    return base / data["target"], base / data["draft"], out, options


def _options(recipe: Path, data: dict, own: set[str]) -> dict:
    """The recipe's export options, checked now (before any model is built or loaded); a key
    that is neither is named (a misspelt option would be dropped, and the bundle built
    without it)."""
    names = {f.name for f in fields(ExportOptions)}
    unknown = sorted(set(data) - names - own)
    if unknown:
        known = sorted(own | names)
        close = [m for key in unknown for m in difflib.get_close_matches(key, known, 1)]
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise ExportError(f"recipe {recipe}: unknown key(s) {unknown}{hint}; known: {known}")
    options = {key: value for key, value in data.items() if key in names}
    try:
        ExportOptions.from_settings(options)
    except ExportError as exc:
        raise ExportError(f"recipe {recipe}: {exc}") from exc
    return options

"""What an export can be asked for, and its defaults: one home for the CLI, recipes and library.

Imports nothing beyond the standard library, so the CLI can offer these choices without the
`export` extra installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from specrt.errors import ExportError

# Tested end to end (tests/test_export.py builds a tiny model of each); each also gets an
# onnxruntime engine where its shape allows (`ort_graph.unsupported_reason`).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "gpt2")
PRECISIONS = ("float32", "int8", "int4")  # of a draft engine's weights
DEFAULT_ATOL = 1e-3
DEFAULT_DRAFT_PRECISION = "int8"


@dataclass(frozen=True)
class ExportOptions:
    """``atol``: the largest |logit difference| to PyTorch an export may show. ``opset``: the
    ONNX opset (None: optimum's). ``slim``: simplify the portable graphs with onnxslim (still
    standard ops). ``ort_engine``: also build each model's onnxruntime engine (fused graph,
    in-place KV cache). ``draft_precision``: the draft engine's weights (a cheaper draft, the
    same output: every token is still decided by the float32 target)."""

    atol: float = DEFAULT_ATOL
    opset: int | None = None
    slim: bool = False
    ort_engine: bool = True
    draft_precision: str = DEFAULT_DRAFT_PRECISION

    def __post_init__(self) -> None:
        if not (isinstance(self.atol, (int, float)) and self.atol > 0):
            raise ExportError(f"atol={self.atol} must be > 0")
        if self.draft_precision not in PRECISIONS:
            raise ExportError(
                f"draft precision {self.draft_precision!r} is unknown; use one of "
                f"{', '.join(PRECISIONS)}"
            )

    @classmethod
    def from_settings(cls, *settings: Mapping[str, Any]) -> ExportOptions:
        """Options from mappings of option name to value (a recipe's, then the command line's):
        a later mapping wins, and a None value means "not given"."""
        names = {f.name for f in fields(cls)}
        options = cls()
        for mapping in settings:
            unknown = set(mapping) - names
            if unknown:
                raise ExportError(
                    f"unknown export option(s) {sorted(unknown)}; known: {sorted(names)}"
                )
            given = {key: value for key, value in mapping.items() if value is not None}
            options = replace(options, **given)
        return options

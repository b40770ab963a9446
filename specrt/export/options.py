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
# Families the onnxruntime engine is built for; the others run their portable graph.
ENGINE_MODEL_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gpt2",
)
SUPPORTED_MODEL_TYPES = ENGINE_MODEL_TYPES
PRECISIONS = ("float32", "int8", "int4")  # of a CPU engine's weights
DEFAULT_ATOL = 1e-3
DEFAULT_FP16_ATOL = 0.1  # float16 engines: ~1e-2 on the demo pair, more on larger models
DEFAULT_DRAFT_PRECISION = "int8"
# A quantised target's weights share a scale (and zero point) in blocks of this many. 32:
# onnxruntime-genai's, whose int4 output stays closest to the float32 model's (docs/cli.md);
# larger blocks make each verified position cheaper (CHANGELOG.md, 2026-12-05).
TARGET_BLOCK_SIZES = (32, 64, 128)
DEFAULT_TARGET_BLOCK_SIZE = 32


def target_tag(precision: str, block_size: int) -> str:
    """How a target engine's weights are named where a head records what it learnt from:
    "float32", or the precision and its block size ("int4/32")."""
    return precision if precision == "float32" else f"{precision}/{block_size}"


DEVICES = ("cpu", "cuda")  # what engines are built for: cuda adds the float16 GPU engines
CUDA_ATTENTIONS = ("batched", "batched_lengths", "group_query")  # the cuda graph (ExportOptions)
CUDA_REDUCTIONS = ("direct", "chunked")  # how its greedy outputs reduce (see ExportOptions)
MIN_OPSET = 14  # what the exported attention and norms need (optimum's own floor for them)


@dataclass(frozen=True)
class ExportOptions:
    """``atol``: the largest |logit difference| to PyTorch an export may show. ``opset``: the
    ONNX opset (None: optimum's). ``slim``: simplify the portable graphs with onnxslim (still
    standard ops). ``ort_engine``: also build each model's onnxruntime engines (fused graph,
    in-place KV cache). ``draft_precision``: the CPU draft engine's weights (a cheaper draft,
    the same output: every token is still decided by the target). ``target_precision``: the CPU
    target engine's weights; int8/int4 make a faster target whose own output (not the float32
    checkpoint's) the speculative output then equals exactly; ``target_block_size``: how many of
    its weights share a scale (`TARGET_BLOCK_SIZES`). ``devices``: "cpu"
    builds the CPU engines, "cuda" the float16 engines for the CUDA provider (checked against
    PyTorch within ``fp16_atol``). ``portable``: also write the portable standard-op graph (what
    TensorRT takes; needs optimum-onnx); without it a model's own graph is its first engine.
    ``cuda_attention``: the cuda engine's graph, "batched" (many rows per call, the Attention op
    under a mask), "batched_lengths" (the same, attending by each row's length: the form the
    CUDA provider's flash attention takes; models with sliding windows keep the mask) or
    "group_query" (one row per call, GroupQueryAttention's kernels, what models with attention
    soft-capping always get), to compare them on a GPU.
    ``cuda_reductions``: how the cuda engines' greedy outputs reduce the vocabulary, "chunked"
    (two stages) or "direct" (one ArgMax / ReduceMax a row): the same numbers; docs/gpu.md
    says why chunked is the default and how a GPU compares the two."""

    atol: float = DEFAULT_ATOL
    opset: int | None = None
    slim: bool = False
    ort_engine: bool = True
    draft_precision: str = DEFAULT_DRAFT_PRECISION
    target_precision: str = "float32"
    target_block_size: int = DEFAULT_TARGET_BLOCK_SIZE
    devices: tuple[str, ...] = ("cpu",)
    fp16_atol: float = DEFAULT_FP16_ATOL
    portable: bool = True
    cuda_attention: str = "batched"
    cuda_reductions: str = "chunked"

    @property
    def cpu_engine(self) -> bool:
        return self.ort_engine and "cpu" in self.devices

    @property
    def cuda_engine(self) -> bool:
        return self.ort_engine and "cuda" in self.devices

    def __post_init__(self) -> None:
        for name in ("atol", "fp16_atol"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ExportError(f"{name}={value!r} must be a number > 0")
            if not value > 0:
                raise ExportError(f"{name}={value} must be > 0")
        for name in ("slim", "ort_engine", "portable"):
            if not isinstance(getattr(self, name), bool):
                raise ExportError(f"{name}={getattr(self, name)!r} must be true or false")
        opset = self.opset
        if opset is not None and (
            isinstance(opset, bool) or not isinstance(opset, int) or not MIN_OPSET <= opset
        ):
            raise ExportError(f"opset={opset!r}: use an integer >= {MIN_OPSET}, or leave it out")
        if not isinstance(self.devices, (str, list, tuple)):
            raise ExportError(f"devices={self.devices!r}: use one or more of {DEVICES}")
        devices = (self.devices,) if isinstance(self.devices, str) else tuple(self.devices)
        object.__setattr__(self, "devices", devices)
        unknown = [d for d in self.devices if d not in DEVICES]
        if unknown or not self.devices:
            raise ExportError(f"devices={self.devices!r}: use one or more of {DEVICES}")
        if not (self.portable or self.ort_engine):
            raise ExportError("a bundle needs a graph: keep the portable graph or the engines")
        if self.cuda_attention not in CUDA_ATTENTIONS:
            raise ExportError(
                f"cuda_attention={self.cuda_attention!r}: use one of {', '.join(CUDA_ATTENTIONS)}"
            )
        if self.cuda_reductions not in CUDA_REDUCTIONS:
            raise ExportError(
                f"cuda_reductions={self.cuda_reductions!r}: use one of "
                + ", ".join(CUDA_REDUCTIONS)
            )
        if self.cuda_attention != "batched" and "cuda" not in self.devices:
            raise ExportError(
                f"cuda_attention={self.cuda_attention!r} shapes the cuda engines: add --device "
                "cuda (devices: cuda), or leave it out"
            )
        for role in ("draft", "target"):
            precision = getattr(self, f"{role}_precision")
            if precision not in PRECISIONS:
                raise ExportError(
                    f"{role} precision {precision!r} is unknown; use one of {', '.join(PRECISIONS)}"
                )
        check_block_size(self.target_precision, self.target_block_size)

    @classmethod
    def from_settings(cls, *settings: Mapping[str, Any]) -> ExportOptions:
        """Options from mappings of option name to value (a recipe's, then the command line's):
        a later mapping wins, and a None value means "not given"."""
        names = {f.name for f in fields(cls)}
        merged: dict[str, Any] = {}  # checked once, together (options depend on each other)
        given_at: dict[str, int] = {}  # which mapping gave each option last
        for at, mapping in enumerate(settings):
            unknown = set(mapping) - names
            if unknown:
                raise ExportError(
                    f"unknown export option(s) {sorted(unknown)}; known: {sorted(names)}"
                )
            given = {key: value for key, value in mapping.items() if value is not None}
            merged.update(given)
            given_at.update(dict.fromkeys(given, at))
        options = replace(cls(), **merged)
        if not options.cpu_engine:
            # a precision given with (or after) the choice of no CPU engine would build
            # nothing: the user expects an engine they will not get. A recipe's precision
            # that the command line's --no-ort-engine overrides is not that.
            off = max(given_at.get("ort_engine", 0), given_at.get("devices", 0))
            left_out = "devices without cpu" if options.ort_engine else "ort_engine false"
            for name, default in (
                ("draft_precision", DEFAULT_DRAFT_PRECISION),
                ("target_precision", "float32"),
            ):
                if given_at.get(name, -1) >= off and getattr(options, name) != default:
                    raise ExportError(
                        f"{name}={getattr(options, name)} sets the CPU engine's weights, and "
                        f"{left_out} builds no CPU engine: give one of the two"
                    )
        return options


def check_block_size(precision: str, block_size: int) -> None:
    """A block size is a quantised target's: given with a float32 one it would be ignored."""
    if isinstance(block_size, bool) or block_size not in TARGET_BLOCK_SIZES:
        raise ExportError(
            f"target_block_size={block_size!r}: use one of "
            + ", ".join(str(size) for size in TARGET_BLOCK_SIZES)
        )
    if precision == "float32" and block_size != DEFAULT_TARGET_BLOCK_SIZE:
        raise ExportError(
            f"target_block_size={block_size} is for a quantised target, and this one is float32: "
            "give it with a target precision of int8 or int4, or leave it out"
        )

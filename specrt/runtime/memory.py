"""The KV cache's memory: what one position of a row costs, and how many rows of how many
positions a budget holds.

A service takes its whole cache at start (no request pays for an allocation), and a batch job's
grows with its longest row up to the same size, so rows x positions must fit the memory the
machine can give, whatever the model: 16 requests x 8192 positions is 6 GiB for a 135M model and
far more for an 8B one. As vLLM's ``--kv-cache-memory`` does, a budget decides: the positions a
row holds stay as asked (capped at the model's), and the rows are as many as fit, at most as
asked; where not even one row fits, that row is shortened.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from specrt.backends.session import GPU_PROVIDERS, default_providers, provider_names
from specrt.bundle import CUDA_ENGINE, ONNXRUNTIME_ENGINE, Manifest, read_manifest
from specrt.errors import InvalidInputError
from specrt.validation import integer

AUTO = "auto"
# An automatic budget on the CPU: this share of the memory available at start (the rest for the
# weights, onnxruntime's activations and everything else on the machine).
AUTO_SHARE = 0.5
MIN_POSITIONS = 16  # a row shorter than this holds no useful prompt and answer
ITEMSIZE = {"float32": 4, "float16": 2}
UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30}
UNITS["ti"] = 2**40


@dataclass
class CachePlan:
    """Rows and positions per row of the KV cache, and why."""

    max_batch: int
    max_length: int
    bytes_per_position: int  # one position of one row, every layer of target and draft
    budget: int | None  # bytes, None: none (a GPU's cache, asked for without one)
    source: str  # where the budget came from, for the log line

    @property
    def bytes(self) -> int:
        return self.max_batch * self.max_length * self.bytes_per_position

    def describe(self, batch_noun: str = "rows") -> str:
        return (
            f"KV cache {_size(self.bytes)}: {self.max_batch} {batch_noun} x {self.max_length} "
            f"positions, {_size(self.bytes_per_position)} a position ({self.source})"
        )


def parse_size(text: str) -> int | None:
    """Bytes of a size such as ``4GiB``, ``512MB``, ``1.5G`` or ``1000000``; None for
    ``auto``. `InvalidInputError` for anything else."""
    text = str(text).strip()
    if text.lower() == AUTO:
        return None
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?)?b?", text, re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise InvalidInputError(
            f"{text!r} is not a memory size: give bytes or a number with a unit, e.g. 4GiB, "
            "512MiB, 2GB (or auto)"
        )
    return int(float(match.group(1)) * UNITS[(match.group(2) or "").lower()])


def bytes_per_position(
    manifest: Manifest, engine: str = "auto", providers: Sequence | None = None
) -> int:
    """One position of one row in every layer of target and draft (keys and values), in the
    type of the graphs that run for ``engine`` and ``providers``."""
    provider = provider_names(providers or default_providers())[0]
    total = 0
    for spec in manifest.models.values():
        wanted = engine
        if engine == "auto":
            wanted = CUDA_ENGINE if provider == "CUDAExecutionProvider" else ONNXRUNTIME_ENGINE
        dtype = spec.engines[wanted].dtype if wanted in spec.engines else spec.dtype
        total += 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * ITEMSIZE[dtype]
    return total


def plan_cache(
    manifest: Manifest,
    budget: int | None,
    max_batch: int,
    max_length: int,
    engine: str = "auto",
    providers: Sequence | None = None,
    budget_name: str = "--kv-cache-memory",
) -> CachePlan:
    """Rows and positions for ``budget`` bytes of KV cache (None: automatic, `AUTO_SHARE` of
    the memory available now on the CPU; no limit for a GPU's cache, whose memory is not read
    here): ``max_length`` positions a row (capped at the models'), as many rows as fit up to
    ``max_batch``, or one shorter row where not even one fits. ``manifest``: a bundle's
    (`specrt.bundle.read_manifest`) or its directory; ``budget``: bytes, or a size such as
    "4GiB"."""
    if isinstance(manifest, (str, os.PathLike)):
        manifest = read_manifest(manifest)
    if not isinstance(manifest, Manifest):
        raise InvalidInputError(
            f"plan_cache takes a bundle's Manifest (specrt.bundle.read_manifest) or its "
            f"directory, not {type(manifest).__name__}"
        )
    if isinstance(budget, str):
        budget = parse_size(budget)
    if budget is not None:
        budget = integer(budget_name, budget, 1, rule='give bytes, or a size such as "4GiB"')
    max_batch = integer("max_batch", max_batch, 1)
    max_length = integer("max_length", max_length, 1)
    per_position = bytes_per_position(manifest, engine, providers)
    length = min([max_length, *(spec.max_positions for spec in manifest.models.values())])
    source = f"{budget_name} {_size(budget)}" if budget is not None else ""
    if budget is None:
        names = provider_names(providers or default_providers())
        if names[0] in GPU_PROVIDERS:
            return CachePlan(max_batch, length, per_position, None, "on the GPU, as asked")
        available = available_memory()
        budget = int(available * AUTO_SHARE)
        source = (
            f"{budget_name} auto: {AUTO_SHARE:.0%} of the {_size(available)} available; "
            f"set {budget_name} to change it"
        )
    rows = min(max_batch, budget // (length * per_position))
    if rows >= 1:
        return CachePlan(rows, length, per_position, budget, source)
    length = budget // per_position
    if length < MIN_POSITIONS:
        raise InvalidInputError(
            f"{budget_name} {_size(budget)} holds {length} positions of this bundle's KV cache "
            f"({_size(per_position)} each); give at least {_size(MIN_POSITIONS * per_position)}"
        )
    return CachePlan(1, length, per_position, budget, source)


def available_memory() -> int:
    """Bytes of memory available to a new allocation now (Linux: MemAvailable; elsewhere all
    of it)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _size(count: int | None) -> str:
    if count is None:
        return "unlimited"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"

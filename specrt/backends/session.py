"""onnxruntime session creation with options chosen for the machine.

Each session has its own intra-op pool whose worker threads spin for a while after every call.
Draft and target alternate, so two multi-threaded pools fight over the cores (docs/performance.md
has the numbers). The draft therefore runs on one thread (no worker to spin) and the target on
all cores. A process-wide shared pool would do as well but breaks every other onnxruntime
session in the process, so a library must not set it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import onnxruntime as ort

from specrt.errors import BundleError


def default_providers() -> list[str]:
    """CUDA when onnxruntime-gpu sees a GPU, else CPU."""
    available = ort.get_available_providers()
    preferred = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return [p for p in preferred if p in available] or ["CPUExecutionProvider"]


def create_session(
    path: str | Path,
    threads: int | None = None,
    providers: Sequence[str | tuple[str, dict[str, str]]] | None = None,
) -> ort.InferenceSession:
    """Open one ONNX graph. ``threads`` sets intra-op threads (default: all cores);
    ``providers``: names, or (name, provider options) pairs."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads or (os.cpu_count() or 1)
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    path = Path(path)
    for file in (path, *path.parent.glob(f"{path.name}.*")):  # the graph and its weights
        if file.is_file() and not os.access(file, os.R_OK):
            raise BundleError(f"cannot read {file} (permission denied); check its permissions")
    try:
        return ort.InferenceSession(
            str(path), sess_options=options, providers=list(providers or default_providers())
        )
    except Exception as exc:  # onnxruntime raises its own untyped errors for bad graphs
        raise BundleError(
            f"onnxruntime cannot load {path}: {exc}; the file is broken or incomplete, "
            "re-export the bundle"
        ) from exc

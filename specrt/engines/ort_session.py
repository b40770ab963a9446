"""onnxruntime session creation with options chosen for the machine.

Draft and target run one after the other, never at once, so they share ONE intra-op thread pool
for the whole process. Two per-session pools would each keep worker threads spinning after their
calls and fight over the cores: on the 2-core demo that made speculative decoding 0.64x the target
alone, against 1.4x with the shared pool (see the README's performance notes).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_state

from specrt.errors import BundleError

_shared_pool_threads: int | None = None  # size of the process-wide pool once it is set up


def default_providers() -> list[str]:
    """CUDA when onnxruntime-gpu sees a GPU, else CPU."""
    available = ort.get_available_providers()
    preferred = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return [p for p in preferred if p in available] or ["CPUExecutionProvider"]


def _use_shared_pool(threads: int) -> bool:
    """Size the process-wide pool on first use; False if onnxruntime refuses (then per session)."""
    global _shared_pool_threads
    if _shared_pool_threads is None:
        try:
            _ort_state.set_global_thread_pool_sizes(threads, 1)
            _shared_pool_threads = threads
        except (AttributeError, RuntimeError):
            _shared_pool_threads = 0
    return _shared_pool_threads > 0


def create_session(
    path: str | Path,
    threads: int | None = None,
    providers: Sequence[str] | None = None,
) -> ort.InferenceSession:
    """Open one ONNX graph. ``threads``: intra-op threads (default: all cores). The process-wide
    pool is sized by the first session opened; later ``threads`` values do not resize it."""
    threads = threads or os.cpu_count() or 1
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    if _use_shared_pool(threads):
        options.use_per_session_threads = False
    else:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    try:
        return ort.InferenceSession(
            str(path), sess_options=options, providers=list(providers or default_providers())
        )
    except Exception as exc:  # onnxruntime raises its own untyped errors for bad graphs
        raise BundleError(
            f"onnxruntime cannot load {path}: {exc}; the file is broken or incomplete, "
            "re-export the bundle"
        ) from exc

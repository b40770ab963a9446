"""onnxruntime session creation with options chosen for the machine.

Each session has its own intra-op pool whose worker threads spin for a while after every call.
Draft and target alternate, so two multi-threaded pools fight over the cores (docs/performance.md
has the numbers). The draft therefore runs on one thread (no worker to spin) and the target on
all cores. A process-wide shared pool would do as well but breaks every other onnxruntime
session in the process, so a library must not set it.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import onnxruntime as ort

from specrt.errors import BundleError

GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


def default_providers() -> list[str]:
    """CUDA where onnxruntime-gpu is installed and the machine has an NVIDIA GPU, else CPU."""
    preferred = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return [p for p in preferred if p in usable_providers()] or ["CPUExecutionProvider"]


def provider_names(providers: Sequence[str | tuple[str, dict]]) -> list[str]:
    """The providers' names, whether given as names or as (name, options) pairs."""
    return [p if isinstance(p, str) else p[0] for p in providers]


def usable_providers(available: Sequence[str] | None = None) -> list[str]:
    """``available`` (default: this onnxruntime's) less the GPU providers where no GPU is
    visible: onnxruntime-gpu lists them on any machine, and a session asking for them falls
    back to the CPU with a red error and without the CPU engine."""
    available = list(ort.get_available_providers() if available is None else available)
    if cuda_devices():
        return available
    return [p for p in available if p not in GPU_PROVIDERS]


@functools.cache
def cuda_devices() -> int:
    """NVIDIA GPUs the CUDA driver shows this process (``CUDA_VISIBLE_DEVICES`` applies), 0
    where there is no driver."""
    try:
        driver = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def create_session(
    path: str | Path,
    threads: int | None = None,
    providers: Sequence[str | tuple[str, dict[str, str]]] | None = None,
) -> ort.InferenceSession:
    """Open one ONNX graph. ``threads`` sets intra-op threads (default: all cores; one where a
    GPU provider runs the graph);
    ``providers``: names, or (name, provider options) pairs."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    names = provider_names(providers or default_providers())
    on_gpu = names[0] in GPU_PROVIDERS  # its threads only run what falls back to the CPU
    options.intra_op_num_threads = threads or (1 if on_gpu else (os.cpu_count() or 1))
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    path = Path(path)
    for file in (path, *path.parent.glob(f"{path.name}.*")):  # the graph and its weights
        if file.is_file() and not os.access(file, os.R_OK):
            raise BundleError(f"cannot read {file} (permission denied); check its permissions")
    weights = [] if on_gpu else weights_in_memory(options, path)
    try:
        return ort.InferenceSession(
            str(path), sess_options=options, providers=list(providers or default_providers())
        )
    except Exception as exc:  # onnxruntime raises its own untyped errors for bad graphs
        raise BundleError(
            f"onnxruntime cannot load {path}: {exc}; the file is broken or incomplete, "
            "re-export the bundle"
        ) from exc
    finally:
        for weight in weights:
            weight.close()


def weights_in_memory(options: ort.SessionOptions, path: Path) -> list[mmap.mmap]:
    """Give onnxruntime the graph's external weight files (``model.onnx.data``, optimum's
    ``model.onnx_data``) from memory, which it copies. Otherwise, on the CPU, it maps the files
    and runs on their pages: a file rewritten in place changes a loaded model's outputs, and
    one cut short kills the process (SIGBUS). The maps returned are closed once the session is
    made (a GPU provider copies the weights to the device anyway)."""
    names, maps = [], []
    for file in sorted(path.parent.glob(f"{path.name}?*")):
        if file.is_file() and file.stat().st_size:
            with open(file, "rb") as handle:
                maps.append(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
            names.append(file.name)
    if maps:
        options.add_external_initializers_from_files_in_memory(
            names, maps, [len(weights) for weights in maps]
        )
    return maps

"""specrt: lossless speculative decoding outside PyTorch (ONNX Runtime, TensorRT).

    from specrt import GenerationConfig, SpeculativeGenerator

    generator = SpeculativeGenerator.from_bundle("engines/demo")
    [result] = generator.generate(["def fibonacci(n):"], GenerationConfig(max_new_tokens=64))

The public API lives here; each name is imported from its module on first use, so `import
specrt` stays light (the export commands do not load onnxruntime before they need it) and the
Ray adapter's import of Ray happens only for those who ask for it.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> the module that holds it
_API = {
    "SpeculativeGenerator": "specrt.runtime.generator",
    "GenerationConfig": "specrt.runtime.config",
    "GenerationResult": "specrt.runtime.results",
    "GenerationStats": "specrt.runtime.results",
    "Request": "specrt.runtime.batching",
    "SuffixCache": "specrt.runtime.lookup",
    "Service": "specrt.runtime.service",
    "RequestHandle": "specrt.runtime.handles",
    "plan_cache": "specrt.runtime.memory",
    "run_batch": "specrt.jobs.batch",
    "SpecrtPredictor": "specrt.jobs.ray_data",
    "SpecrtError": "specrt.errors",
    "BundleError": "specrt.errors",
    "InvalidInputError": "specrt.errors",
    "PromptTooLongError": "specrt.errors",
    "UnknownSettingError": "specrt.errors",
    "NumericalError": "specrt.errors",
    "OverloadedError": "specrt.errors",
    "ServiceClosedError": "specrt.errors",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> object:
    if name not in _API:
        raise AttributeError(f"module 'specrt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

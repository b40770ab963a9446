"""HF checkpoint pair -> bundle: portable ONNX graphs, onnxruntime engines, numeric checks.

Needs the `export` extra (torch, transformers, optimum-onnx), except `options`, which the CLI
reads for its choices; nothing at run time imports this package.
"""

from specrt.export.options import ENGINE_MODEL_TYPES, SUPPORTED_MODEL_TYPES, ExportOptions

__all__ = ["ENGINE_MODEL_TYPES", "SUPPORTED_MODEL_TYPES", "ExportOptions", "export_bundle"]


def __getattr__(name: str):
    # export_bundle pulls in torch and transformers: imported when asked for, not with options.
    if name == "export_bundle":
        from specrt.export.pipeline import export_bundle

        return export_bundle
    raise AttributeError(f"module 'specrt.export' has no attribute {name!r}")

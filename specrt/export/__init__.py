"""HF checkpoint pair -> bundle. Needs the `export` extra (torch, transformers, optimum-onnx)."""

from specrt.export.pipeline import SUPPORTED_MODEL_TYPES, export_bundle

__all__ = ["SUPPORTED_MODEL_TYPES", "export_bundle"]

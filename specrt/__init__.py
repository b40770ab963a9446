"""specrt: lossless speculative decoding outside PyTorch (ONNX Runtime, TensorRT)."""

__version__ = "0.1.0"

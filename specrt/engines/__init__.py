"""ONNX -> what runs: onnxruntime sessions (and, later, TensorRT plans)."""

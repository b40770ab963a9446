"""The target as its quantised engine computes it, in PyTorch: a draft for an int4 target.

An int4 target is a different model from its float32 checkpoint: its answers differ, and so do
the states a head reads, so a head for it should learn from it. `specrt distill
--target-precision int4`
gives every linear layer of the target (the output layer too, untied from the embedding, which
the engine gathers unquantised) the very weights the engine's MatMulNBits holds: quantised by
onnxruntime's own routine, with the block size and zero points of `specrt export`'s target,
then read back as float32. What is left between the two is the engine's 8-bit activations,
which cost a head more than the weights do (docs/eagle.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def engine_weights(weight: np.ndarray, bits: int, block_size: int) -> np.ndarray:
    """``weight`` ([out, in], float32) as the target's MatMulNBits engine holds it: blocks of
    ``block_size`` along the input, each with its scale and zero point (asymmetric, as
    `specrt.export.ort_engine` quantises a target), read back as float32."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    rows, cols = weight.shape[1], weight.shape[0]  # MatMul's B is the weight transposed
    blocks = -(-rows // block_size)
    b = np.zeros((blocks * block_size, cols), dtype=np.float32)
    b[:rows] = weight.T
    per_byte = 8 // bits
    packed = np.zeros((cols, blocks, block_size // per_byte), dtype=np.uint8)
    zero_points = np.zeros((cols, -(-blocks // per_byte)), dtype=np.uint8)
    scales = np.zeros((cols, blocks), dtype=np.float32)
    quantize = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    quantize(packed, b, scales, zero_points, block_size, cols, rows, False)
    if bits == 4:  # two values a byte, the first in the low nibble
        values = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(cols, blocks, block_size)
        zeros = np.stack([zero_points & 0xF, zero_points >> 4], axis=-1).reshape(cols, -1)
        zeros = zeros[:, :blocks]
    else:
        values, zeros = packed, zero_points
    dequantized = (values.astype(np.float32) - zeros[:, :, None]) * scales[:, :, None]
    return dequantized.reshape(cols, -1)[:, :rows]


def quantize_like_engine(model: torch.nn.Module, precision: str, block_size: int) -> None:
    """Give every linear layer of ``model`` its weights in the ``precision`` target engine of
    that ``block_size`` (in place; the output layer untied from the input embedding)."""
    import torch

    bits = {"int8": 8, "int4": 4}[precision]
    output = model.get_output_embeddings()
    if output.weight is model.get_input_embeddings().weight:
        output.weight = torch.nn.Parameter(output.weight.detach().clone())
        model.config.tie_word_embeddings = False
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                weight = module.weight.detach().float().numpy()
                module.weight.copy_(torch.from_numpy(engine_weights(weight, bits, block_size)))

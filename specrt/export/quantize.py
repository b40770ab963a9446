"""Weight-only quantisation of a draft engine (onnxruntime's MatMulNBits).

A draft's precision changes how often its guesses are accepted, never what the output is: every
token is still decided by the full-precision target. On CPU a small model's step is bound by
reading its weights, so 8-bit weights make the draft step several times cheaper (demo pair,
measured with `specrt bench`: CHANGELOG.md, 2026-11-29) while its acceptance stays the same.
The target is never quantised.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

from specrt.export.options import PRECISIONS

_BITS = {"int8": 8, "int4": 4}
BLOCK_SIZE = 128


def quantize_weights(graph: Path, precision: str) -> None:
    """Rewrite ``graph`` (and its external data) with MatMul weights in ``precision``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if precision == "float32":
        return
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    bits = _BITS[precision]
    config = DefaultWeightOnlyQuantConfig(
        block_size=BLOCK_SIZE, is_symmetric=True, accuracy_level=4, bits=bits
    )
    quantizer = MatMulNBitsQuantizer(
        onnx.load(str(graph)),
        bits=bits,
        block_size=BLOCK_SIZE,
        is_symmetric=True,
        accuracy_level=4,  # int8 compute: what makes it fast on CPUs with VNNI/AMX
        algo_config=config,
    )
    quantizer.process()
    model = quantizer.model.model
    data = graph.with_name(graph.name + ".data")
    data.unlink(missing_ok=True)
    onnx.save_model(
        model,
        str(graph),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data.name,
        size_threshold=1024,
    )

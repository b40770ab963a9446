"""Weight-only quantisation of an engine (onnxruntime's MatMulNBits, int8 compute).

A draft's precision changes how often its guesses are accepted, never what the output is: every
token is still decided by the target. On CPU a small model's step is bound by reading its
weights, so 8-bit weights make the draft step several times cheaper (demo pair, measured with
`specrt bench`: CHANGELOG.md, 2026-11-29) while its acceptance stays the same.

A quantised target is a different model: the output is then exactly that engine's own
target-alone output, not the float32 checkpoint's. That holds only if verifying several
positions in one call computes each position's logits bit for bit as decoding it alone does:
the target's graph computes an even number of positions in every call (`ort_builder._even_rows`),
the one row count whose kernels give a row the same bits whoever its partner is, on every CPU
measured (AVX-512/AMX and AVX2 alike; CHANGELOG.md, 2026-12-05).
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

from specrt.export.options import PRECISIONS

_BITS = {"int8": 8, "int4": 4}
BLOCK_SIZE = 128  # a draft's: the fastest measured


def quantize_weights(
    graph: Path,
    precision: str,
    block_size: int = BLOCK_SIZE,
    symmetric: bool = True,
    accuracy_level: int = 4,
) -> None:
    """Rewrite ``graph`` (and its external data) with MatMul weights in ``precision``, in
    blocks of ``block_size`` along the input dimension (``symmetric``: without zero points).
    ``accuracy_level`` 4: int8 compute, what makes it fast on CPUs with VNNI/AMX (0: float32,
    the weights' own products, for tests)."""
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
        block_size=block_size, is_symmetric=symmetric, accuracy_level=accuracy_level, bits=bits
    )
    quantizer = MatMulNBitsQuantizer(
        onnx.load(str(graph)),
        bits=bits,
        block_size=block_size,
        is_symmetric=symmetric,
        accuracy_level=accuracy_level,
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


def not_invariant(check: dict, precision: str) -> str | None:
    """What is wrong where a quantised target's verification would not compute what decoding
    alone does on this CPU (the export check's measure); None where it does."""
    difference = check["step_vs_one_at_a_time_max_abs_diff"]
    if precision == "float32" or not difference:
        return None
    return (
        f"the {precision} target engine's logits for several positions in one call differ from "
        f"decoding them one at a time by {difference:.2e} on this CPU, so speculative output "
        "may differ from this engine's own output alone; export with --target-precision "
        "float32 where it must not"
    )

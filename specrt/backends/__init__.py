"""What runs a graph: backends behind one `Decoder` protocol (`base.py`).

`batched.BatchedDecoder` runs the onnxruntime engine (fused graph, KV cache updated in place,
many rows per call), `in_place.InPlaceDecoder` its one-row form from earlier versions,
`portable.PortableDecoder` the portable standard-op graph (`PortableRowsDecoder`: many rows),
`device_rows.DeviceRowsDecoder` the cuda engine (many rows per call) with its cache in GPU
memory, `device.DeviceDecoder` the one-row cuda engine (GroupQueryAttention: Gemma 2's
soft-capping, and bundles of earlier versions); `select.open_decoder` picks one for the
requested providers.
"""

from specrt.backends.base import (
    NEED_ARGMAX,
    NEED_LOGITS,
    NEED_PROBABILITIES,
    Decoder,
    Forward,
)
from specrt.backends.batched import BatchedDecoder
from specrt.backends.rows import RowsDecoder
from specrt.backends.select import DEFAULT_MAX_LENGTH, ENGINE_CHOICES, open_decoder

__all__ = [
    "BatchedDecoder",
    "DEFAULT_MAX_LENGTH",
    "ENGINE_CHOICES",
    "NEED_ARGMAX",
    "NEED_LOGITS",
    "NEED_PROBABILITIES",
    "Decoder",
    "Forward",
    "RowsDecoder",
    "open_decoder",
]

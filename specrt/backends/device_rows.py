"""The batched engine with its KV cache in device memory: many rows per call on the CUDA
provider.

The graph is the batched engine's (`batched.py`: each call writes the new k and v at ``(row,
position)`` and attends under a mask), in float16, with the cuda engine's outputs. Its cache is
one device buffer per layer and kind, ``[max_batch, capacity, kv_heads * head_dim]``; a call's
rows ``start .. start + n`` are bound by address (base + ``start`` rows), so a call never copies
the cache. The host inputs (token ids, positions, cache indices, masks) are copied to the device
by onnxruntime, and the logits come back into host arrays.

What the host does with numpy on the CPU engine's buffers, here runs on the device through a
one-node graph (`DeviceCopy`): copying a row when live rows are packed, and the old content into
a larger buffer when the cache grows.

The same code runs with ``device="cpu"`` (CPU OrtValues, copies by the CPU provider): that is
how it is tested on machines without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from specrt.backends.base import NEED_ARGMAX, NEED_LOGITS, NEED_PROBABILITIES, Forward
from specrt.backends.batched import BatchedDecoder, _CallArrays
from specrt.bundle import ModelSpec
from specrt.errors import BundleError

MAX_KEPT_CALL_SHAPES = 64  # call shapes whose arrays are kept for the next call of that shape
# Positions a device cache grows by at a time: a resize allocates every buffer anew, and a GPU's
# attention over positions no row uses yet costs little (the CPU engine's step is 32).
DEVICE_CAPACITY_STEP = 256
# What each ``need`` brings back to the host; the other outputs stay on the device.
ON_HOST = {
    NEED_LOGITS: ("logits",),
    NEED_PROBABILITIES: ("probabilities",),
    NEED_ARGMAX: ("argmax", "max_logit", "max_probability"),
}


class DeviceRowsDecoder(BatchedDecoder):
    """Runs a batched-cache graph whose cache lives on ``device`` ("cuda" or "cpu")."""

    def __init__(
        self,
        session: ort.InferenceSession,
        spec: ModelSpec,
        vocab_size: int,
        role: str,
        max_length: int | None = None,
        max_batch: int = 1,
        device: str = "cuda",
    ) -> None:
        if spec.vocab_size != vocab_size:
            raise BundleError(
                f"{role}: the device engine's logits are {spec.vocab_size} wide, the bundle's "
                f"vocabulary {vocab_size}; rebuild it: specrt build --bundle DIR --device cuda"
            )
        self.device = device
        self._copy = DeviceCopy(session.get_providers(), device, spec.dtype)
        self._host: list[np.ndarray] = []  # on the CPU: the buffers' memory, kept alive
        self.calls = 0  # model calls, and the bytes their outputs brought back to the host
        self.bytes_to_host = 0
        super().__init__(session, spec, vocab_size, role, max_length, max_batch)

    def forward(
        self, tokens: Sequence[int], keep_last: int = 0, need: str = NEED_LOGITS
    ) -> Forward:
        out = self.forward_rows(np.asarray([tokens], dtype=np.int64), keep_last, need=need)
        fields = (out.logits, out.probabilities, out.argmax, out.max_logit, out.max_probability)
        logits, probabilities, argmax, top, top_p = (None if a is None else a[0] for a in fields)
        return Forward(
            logits, probabilities, None if argmax is None else argmax.tolist(), top, top_p
        )

    @property
    def cache_bytes(self) -> int:
        per_buffer = int(np.prod(self._buffer_shape(self.capacity))) * self._dtype().itemsize
        return len(self._buffers) * per_buffer

    def move_row(self, source: int, dest: int) -> None:
        length = int(self.lengths[source])
        for buffer in self._buffers:
            self._copy.rows(buffer, source, buffer, dest, length, self._width)
        self.lengths[dest] = length
        self.lengths[source] = 0

    def clear_stale(self) -> None:
        # Rare (after NaN logits): through the host.
        for buffer in self._buffers:
            content = buffer.numpy()
            for row, length in enumerate(self.lengths.tolist()):
                content[row, length:] = 0
            buffer.update_inplace(content)

    def _capacity_step(self) -> int:
        return DEVICE_CAPACITY_STEP

    def _resized(self, capacity: int) -> list:
        buffers = []
        self._host = []
        for old in self._buffers or [None] * len(self._names):
            zeros = np.zeros(self._buffer_shape(capacity), self._dtype)
            buffer = ort.OrtValue.ortvalue_from_numpy(zeros, self.device, 0)
            if self.device == "cpu":
                self._host.append(zeros)
            if old is not None:
                for row, length in enumerate(self.lengths.tolist()):
                    if length:
                        self._copy.rows(old, row, buffer, row, length, self._width)
            buffers.append(buffer)
        return buffers

    def _call_key(self, n: int, count: int, keep_last: int, need: str) -> tuple:
        return n, count, keep_last, need

    def _new_arrays(self, key: tuple, width: int) -> _CallArrays:
        """Inputs on the host; of the outputs, what ``need`` names in host arrays (onnxruntime
        copies into them), the others on the device."""
        if len(self._shapes) >= MAX_KEPT_CALL_SHAPES:  # each holds outputs on the device
            self._shapes.clear()
        arrays = _CallArrays(key[:3], width, self._local)
        n, _, keep_last, need = key
        vocab = self.spec.vocab_size
        shapes = {
            "logits": ((n, keep_last, vocab), np.float32),
            "probabilities": ((n, keep_last, vocab), np.float32),
            "argmax": ((n, keep_last), np.int64),
            "max_logit": ((n, keep_last), np.float32),
            "max_probability": ((n, keep_last), np.float32),
        }
        host = {}
        for name, (shape, dtype) in shapes.items():
            if name in ON_HOST[need]:
                host[name] = np.empty(shape, dtype)
                arrays.outputs[name] = ort.OrtValue.ortvalue_from_numpy(host[name])
            else:
                value = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, self.device, 0)
                arrays.outputs[name] = value
        arrays.host_bytes = sum(array.nbytes for array in host.values())
        arrays.result = Forward(host.pop("logits", None), **host)
        return arrays

    def _bind_rows(self, start: int, n: int, width: int) -> None:
        shape = (n, width, self._width)  # one row: its first positions (`VIEW_STEP`)
        offset = start * self.capacity * self._width * self._dtype().itemsize
        for (past, present), buffer in zip(self._names, self._buffers):
            address = buffer.data_ptr() + offset
            self._binding.bind_input(past, self.device, 0, self._dtype, shape, address)
            self._binding.bind_output(present, self.device, 0, self._dtype, shape, address)
        self._rows = (start, n, width)

    def _run(self, start: int, n: int, fed: int | np.ndarray) -> None:
        if self.device != "cpu":
            self._binding.synchronize_inputs()
        super()._run(start, n, fed)
        if self.device != "cpu":
            self._binding.synchronize_outputs()
        self.calls += 1
        self.bytes_to_host += self._bound.host_bytes


class DeviceCopy:
    """Copies between device buffers with a one-node graph (Identity) on the engine's
    provider: onnxruntime's Python API has no device-to-device copy of its own."""

    def __init__(self, providers: list[str], device: str, dtype: str) -> None:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 3
        self.session = ort.InferenceSession(_identity_graph(dtype), options, providers=providers)
        self.device = device
        self.dtype = np.dtype(dtype)
        self.binding = self.session.io_binding()

    def rows(
        self,
        source: ort.OrtValue,
        source_row: int,
        dest: ort.OrtValue,
        dest_row: int,
        length: int,
        width: int,
    ) -> None:
        """Copy the first ``length`` positions of ``source_row`` into ``dest_row`` (buffers
        ``[rows, positions, width]``, of any number of positions)."""
        if not length:
            return
        size = width * self.dtype.itemsize  # bytes per position
        src = source.data_ptr() + source_row * source.shape()[1] * size
        dst = dest.data_ptr() + dest_row * dest.shape()[1] * size
        shape = (length * width,)
        self.binding.bind_input("x", self.device, 0, self.dtype, shape, src)
        self.binding.bind_output("y", self.device, 0, self.dtype, shape, dst)
        self.session.run_with_iobinding(self.binding)


def _identity_graph(dtype: str) -> bytes:
    """A model of one Identity node on a 1-D tensor of ``dtype``, as protobuf bytes written
    here (the runtime does not depend on the onnx package): ModelProto's ir_version (1),
    opset_import (8) and graph (7), with the field numbers of onnx.proto."""
    element = {"float32": 1, "float16": 10}[dtype]  # TensorProto.DataType
    tensor = _message(1, _varint_field(1, element) + _message(2, _message(1, _text(2, "n"))))
    value = {name: _text(1, name) + _message(2, tensor) for name in ("x", "y")}
    node = _text(1, "x") + _text(2, "y") + _text(4, "Identity")
    graph = _message(1, node) + _text(2, "copy") + _message(11, value["x"])
    graph += _message(12, value["y"])
    opset = _text(1, "") + _varint_field(2, 21)
    return _varint_field(1, 10) + _message(8, opset) + _message(7, graph)


def _varint(number: int) -> bytes:
    out = bytearray()
    while True:
        low, number = number & 0x7F, number >> 7
        out.append(low | (0x80 if number else 0))
        if not number:
            return bytes(out)


def _varint_field(field: int, number: int) -> bytes:
    return _varint(field << 3) + _varint(number)


def _message(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _text(field: int, text: str) -> bytes:
    return _message(field, text.encode())

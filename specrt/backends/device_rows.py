"""The batched engine with its KV cache in device memory: many rows per call on the CUDA
provider.

The graph is the batched engine's (`batched.py`: each call writes the new k and v at ``(row,
position)`` and attends under a mask), in float16, with the cuda engine's outputs. Its cache is
one device block per layer and kind, holding ``[max_batch, capacity, kv_heads * head_dim]``; a
call's rows ``start .. start + n`` are bound by address (base + ``start`` rows), so a call never
copies the cache. The host inputs (token ids, positions, cache indices, masks) are written on the
host and pushed to the device before each run (`HostInputs`), and what the round reads comes
back into host arrays.

What the host does with numpy on the CPU engine's buffers runs here on the device through
one-node graphs (`DeviceOps`): copying a row when live rows are packed, moving rows within a
block when the capacity changes, zeroing new memory. As on the CPU a block is kept at the
largest capacity yet, so growing again within it allocates nothing.

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
        device_id: int = 0,
    ) -> None:
        if spec.vocab_size != vocab_size:
            raise BundleError(
                f"{role}: the device engine's logits are {spec.vocab_size} wide, the bundle's "
                f"vocabulary {vocab_size}; rebuild it: specrt build --bundle DIR --device cuda"
            )
        self.device, self.device_id = device, device_id
        self._ops = DeviceOps(device, device_id, spec.dtype)
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
        """Device memory the cache holds now (its blocks, at the largest capacity yet)."""
        itemsize = self._dtype().itemsize
        return sum(int(np.prod(block.shape())) * itemsize for block in self._blocks)

    def copy_row(self, source: int, dest: int, length: int | None = None) -> None:
        length = int(self.lengths[source]) if length is None else length
        self.kept_positions.pop(dest, None)
        if source == dest:  # a finished row's slot taken by a prompt that begins as it did
            self.lengths[dest] = length
            return
        self._copy_features(source, dest, length)  # an EAGLE head's: on the host
        for buffer in self._buffers:
            self._ops.rows(buffer, source, buffer, dest, length)
        self.lengths[dest] = length

    def clear_stale(self) -> None:
        # Rare (after NaN logits): through the host.
        self.kept_positions.clear()
        for buffer in self._buffers:
            content = buffer.numpy()
            for row, length in enumerate(self.lengths.tolist()):
                content[row, length:] = 0
            buffer.update_inplace(content)

    def reserve(self) -> None:
        """Take the blocks of the largest capacity now, zeroed on the device: no later growth
        allocates in the middle of a round. The capacity calls attend over stays as it is."""
        if self.max_batch > 1 and self._block_capacity < self.max_positions:
            self._buffers = self._new_blocks(self.max_positions, self.capacity)
            self._views.clear()
            self._rows = None

    def _capacity_step(self) -> int:
        return DEVICE_CAPACITY_STEP

    def _resized(self, capacity: int) -> list:
        """The buffers at ``capacity`` positions, content kept: views on the blocks, the rows
        moved within them, or new blocks where they are too small."""
        if capacity > self._block_capacity:
            return self._new_blocks(capacity, capacity)
        old, keep = self.capacity, min(self.capacity, capacity)
        # Growing, a row's new place starts past its old one: move the last row first;
        # shrinking, the first (no row lands on one not moved yet).
        order = range(self.max_batch - 1, -1, -1) if capacity > old else range(self.max_batch)
        lengths = self.moved_lengths(keep)
        size = self._width  # elements per position
        for block in self._blocks:
            for row in order:
                count = lengths[row] * size
                self._ops.move(block, row * old * size, row * capacity * size, count)
        return [_View(block, (self.max_batch, capacity, size)) for block in self._blocks]

    def _new_blocks(self, block_capacity: int, capacity: int) -> list:
        """New blocks of ``block_capacity`` positions, zeroed on the device, holding the rows'
        cached positions; the buffers at ``capacity`` positions on them."""
        shape = self._buffer_shape(capacity)
        blocks, buffers = [], []
        for old in self._buffers or [None] * len(self._names):
            size = int(np.prod(self._buffer_shape(block_capacity)))
            block = ort.OrtValue.ortvalue_from_shape_and_type(
                (size,), self._dtype, self.device, self.device_id
            )
            self._ops.zero(block)  # fresh device memory may hold NaN bit patterns
            buffer = _View(block, shape)
            if old is not None:
                for row, length in enumerate(self.moved_lengths(capacity)):
                    self._ops.rows(old, row, buffer, row, length)
            blocks.append(block)
            buffers.append(buffer)
        self._blocks, self._block_capacity = blocks, block_capacity
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
                value = ort.OrtValue.ortvalue_from_shape_and_type(
                    shape, dtype, self.device, self.device_id
                )
                arrays.outputs[name] = value
        arrays.host_bytes = sum(array.nbytes for array in host.values())
        arrays.result = Forward(host.pop("logits", None), **host)
        # An EAGLE head's features (a target's output, every position fed) and hidden states
        # (a head's input and output) are read on the host by `EagleDraft`.
        arrays.eagle_arrays(self._feature_width, self._hidden_width)
        eagle = (getattr(arrays, "features", None), arrays.result.hidden)
        arrays.host_bytes += sum(array.nbytes for array in eagle if array is not None)
        return arrays

    def _bind_rows(self, start: int, n: int, width: int) -> None:
        shape = (n, width, self._width)  # one row: its first positions (`VIEW_STEP`)
        offset = start * self.capacity * self._width * self._dtype().itemsize
        device, device_id, dtype = self.device, self.device_id, self._dtype
        for (past, present), buffer in zip(self._names, self._buffers):
            address = buffer.data_ptr() + offset
            self._binding.bind_input(past, device, device_id, dtype, shape, address)
            self._binding.bind_output(present, device, device_id, dtype, shape, address)
        self._rows = (start, n, width)

    def _execute(self) -> None:
        self._inputs.push()
        if self.device != "cpu":
            self._binding.synchronize_inputs()
        super()._execute()
        if self.device != "cpu":
            self._binding.synchronize_outputs()
        self.calls += 1
        self.bytes_to_host += self._bound.host_bytes


class _View:
    """A cache buffer ``[rows, capacity, width]`` on the first elements of a device block (an
    OrtValue cannot be a view of another)."""

    def __init__(self, block: ort.OrtValue, shape: tuple[int, int, int]) -> None:
        self.block, self._shape = block, shape
        self.size = int(np.prod(shape))

    def data_ptr(self) -> int:
        return self.block.data_ptr()

    def shape(self) -> tuple[int, int, int]:
        return self._shape

    def numpy(self) -> np.ndarray:
        """A host copy of the buffer."""
        return np.array(self.block.numpy()[: self.size]).reshape(self._shape)

    def update_inplace(self, content: np.ndarray) -> None:
        whole = np.array(self.block.numpy())
        whole[: self.size] = content.reshape(-1)
        self.block.update_inplace(whole)


class DeviceOps:
    """Copies and zeroing in device memory with one-node graphs on the engine's provider
    (Identity, ConstantOfShape): onnxruntime's Python API has no device copy or fill of its
    own."""

    def __init__(self, device: str, device_id: int, dtype: str) -> None:
        providers: list = ["CPUExecutionProvider"]
        if device == "cuda":  # on the engine's own GPU
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": str(device_id)}))
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 3
        self.device, self.device_id = device, device_id
        self.dtype = np.dtype(dtype)
        self._copy = ort.InferenceSession(_identity_graph(dtype), options, providers=providers)
        self._copying = self._copy.io_binding()
        self._fill = ort.InferenceSession(_zeros_graph(dtype), options, providers=providers)
        self._filling = self._fill.io_binding()

    def rows(self, source, source_row: int, dest, dest_row: int, length: int) -> None:
        """Copy the first ``length`` positions of ``source_row`` into ``dest_row`` (buffers
        ``[rows, positions, width]`` of any number of positions, not overlapping there)."""
        rows, positions, width = source.shape()
        src = source_row * positions * width
        dst = dest_row * dest.shape()[1] * width
        self._copy_elements(source.data_ptr(), src, dest.data_ptr(), dst, length * width)

    def move(self, block: ort.OrtValue, src: int, dst: int, count: int) -> None:
        """Move ``count`` elements of ``block`` from element ``src`` to ``dst``, which may
        overlap (as memmove): in chunks no longer than the distance, from the far end."""
        shift = dst - src
        if not shift or not count:
            return
        chunk = min(abs(shift), count)
        starts = range(0, count, chunk)
        base = block.data_ptr()
        for start in reversed(starts) if shift > 0 else starts:
            size = min(chunk, count - start)
            self._copy_elements(base, src + start, base, dst + start, size)

    def zero(self, block: ort.OrtValue) -> None:
        """Zero a 1-D device block."""
        count = int(np.prod(block.shape()))
        self._filling.bind_cpu_input("shape", np.array([count], dtype=np.int64))
        self._filling.bind_output(
            "y", self.device, self.device_id, self.dtype, (count,), block.data_ptr()
        )
        self._fill.run_with_iobinding(self._filling)

    def _copy_elements(self, src_base: int, src: int, dst_base: int, dst: int, count: int):
        if not count:
            return
        size = self.dtype.itemsize
        binding, shape = self._copying, (count,)
        args = (self.device, self.device_id, self.dtype, shape)
        binding.bind_input("x", *args, src_base + src * size)
        binding.bind_output("y", *args, dst_base + dst * size)
        self._copy.run_with_iobinding(binding)


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


def _zeros_graph(dtype: str) -> bytes:
    """A model of one ConstantOfShape node (value: a zero of ``dtype``) whose 1-D ``shape``
    input gives the output's length, as protobuf bytes (see `_identity_graph`): NodeProto's
    attribute (5) an AttributeProto of name (1), tensor (5) and type TENSOR (20: 4)."""
    element, itemsize = {"float32": (1, 4), "float16": (10, 2)}[dtype]
    zero = _varint_field(1, 1) + _varint_field(2, element) + _text(8, "value")
    zero += _message(9, bytes(itemsize))  # raw_data
    attribute = _text(1, "value") + _message(5, zero) + _varint_field(20, 4)
    node = _text(1, "shape") + _text(2, "y") + _text(4, "ConstantOfShape")
    node += _message(5, attribute)
    shape_type = _message(1, _varint_field(1, 7) + _message(2, _message(1, _varint_field(1, 1))))
    y_type = _message(1, _varint_field(1, element) + _message(2, _message(1, _text(2, "n"))))
    graph = _message(1, node) + _text(2, "zeros")
    graph += _message(11, _text(1, "shape") + _message(2, shape_type))
    graph += _message(12, _text(1, "y") + _message(2, y_type))
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

"""The inputs a device session reads, written on the host each call.

onnxruntime copies a host value bound as an input of a CUDA session to the device when it is
BOUND (its IOBinding; `run_with_iobinding` does not copy again), so writing the host array after
binding changes nothing the GPU sees. Every host input of a device engine therefore goes through
`HostInputs`: written into its host array, then `push`ed before the run, which either binds it
again (``"rebind"``: the copy at bind time is the upload) or refreshes a device twin bound once
(``"update"``: `OrtValue.update_inplace`). Inputs a CUDA kernel reads on the host
(GroupQueryAttention's total_sequence_length, the start of the Slice that keeps the last rows)
are bound again each call, never given a device twin. On the CPU a bound host value is the array
itself, and `push` has nothing to do.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

# How host inputs reach the device: "rebind" or "update" (device twins). Both are exact; the
# device check times the two (docs/gpu.md: rebind was the faster).
TRANSFER = "rebind"
TRANSFERS = ("update", "rebind")
MAX_TWINS = 256  # device twins kept (one per input name and shape)


class HostInputs:
    """The host arrays bound as inputs of one IOBinding on ``device`` ("cpu", "cuda")."""

    def __init__(self, binding: ort.IOBinding, device: str = "cpu", device_id: int = 0) -> None:
        if TRANSFER not in TRANSFERS:
            raise ValueError(f"TRANSFER={TRANSFER!r}: use one of {', '.join(TRANSFERS)}")
        self._binding = binding
        self.device, self.device_id = device, device_id
        self._transfer = TRANSFER
        # name -> (host array, its host OrtValue, its device twin or None)
        self._bound: dict[str, tuple[np.ndarray, ort.OrtValue, ort.OrtValue | None]] = {}
        self._twins: dict[tuple, ort.OrtValue] = {}

    def bind(
        self,
        name: str,
        array: np.ndarray,
        value: ort.OrtValue | None = None,
        on_host: bool = False,
    ) -> None:
        """Bind ``array`` (C-contiguous, kept by the caller) as input ``name``: each run after a
        `push` reads its content as of that push. ``value``: an OrtValue over ``array``'s
        memory, where the caller keeps one; ``on_host``: a kernel reads it on the host."""
        if value is None:
            value = ort.OrtValue.ortvalue_from_numpy(array)
        twin = None
        if self.device != "cpu" and self._transfer == "update" and not on_host:
            twin = self._twin(name, array)  # filled by the `push` before the run
            self._binding.bind_ortvalue_input(name, twin)
        else:
            self._binding.bind_ortvalue_input(name, value)
        self._bound[name] = (array, value, twin)

    def push(self) -> None:
        """Make what the next run reads equal to every bound array's content now."""
        if self.device == "cpu":  # the bound values are the arrays
            return
        binding = self._binding
        for name, (array, value, twin) in self._bound.items():
            if twin is None:
                binding.bind_ortvalue_input(name, value)  # copied to the device here
            else:
                twin.update_inplace(array)

    def _twin(self, name: str, array: np.ndarray) -> ort.OrtValue:
        """Device memory for ``array``'s shape and type, shared by the arrays of that shape
        bound as ``name`` (each push refreshes it)."""
        key = (name, array.shape, array.dtype.str)
        twin = self._twins.get(key)
        if twin is None:
            if len(self._twins) >= MAX_TWINS:  # a bound twin lives on in the binding
                self._twins.clear()
            twin = self._twins[key] = ort.OrtValue.ortvalue_from_shape_and_type(
                array.shape, array.dtype, self.device, self.device_id
            )
        return twin

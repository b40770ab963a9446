"""The onnxruntime engine with its KV cache in device memory: the CUDA backend.

Each layer's cache is one ``OrtValue`` allocated once on the device and bound as both ``past``
and ``present`` (GroupQueryAttention updates it in place), so the cache never crosses PCIe.
Every output is bound once per call shape; a step writes only small host values (token ids,
two lengths, how many rows to keep) and pushes them to the device before it runs
(`HostInputs`: onnxruntime copies a host input when it is bound, not when it runs).
Of the outputs only what the loop needs comes back (`Forward`'s ``need``): for greedy decoding
each row's argmax and its logit (computed in the graph: K+1 integers and floats), for
temperature-1 sampling the softmax rows, else the logits rows; the rest stays on the device.

The same code runs with ``device="cpu"`` (CPU ``OrtValue``s): that is how it is tested on
machines without a GPU, and how a CUDA engine can be checked on one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from specrt.backends.base import NEED_ARGMAX, NEED_LOGITS, NEED_PROBABILITIES, Forward
from specrt.backends.in_place import InPlaceBase
from specrt.bundle import ModelSpec
from specrt.errors import BundleError

OUTPUTS = ("logits", "probabilities", "argmax", "max_logit", "max_probability")
MAX_KEPT_CALL_SHAPES = 64  # call shapes (tokens fed, rows kept, need) whose bindings are kept


class DeviceDecoder(InPlaceBase):
    """Runs an in-place engine whose cache lives on ``device`` ("cuda" or "cpu")."""

    needs = (*InPlaceBase.needs, "argmax", "max_logit", "max_probability")
    rebuild_hint = (
        "this graph lacks the inputs or outputs of a device engine (lengths, logits_to_keep, "
        "argmax, max_logit, max_probability); build it with `specrt build --bundle DIR "
        "--device cuda`"
    )

    def __init__(
        self,
        session: ort.InferenceSession,
        spec: ModelSpec,
        vocab_size: int,
        role: str,
        max_length: int | None = None,
        device: str = "cuda",
        device_id: int = 0,
    ) -> None:
        if spec.vocab_size != vocab_size:
            raise BundleError(
                f"{role}: the device engine's logits are {spec.vocab_size} wide, the bundle's "
                f"vocabulary {vocab_size}; rebuild it: specrt build --bundle DIR --device cuda"
            )
        super().__init__(session, spec, vocab_size, role, max_length, device, device_id)
        self._calls: dict[tuple[int, int, str], _DeviceCall] = {}
        self._bound: _DeviceCall | None = None
        self.calls = 0  # model calls, and the bytes their outputs brought back to the host
        self.bytes_to_host = 0

    def forward(
        self, tokens: Sequence[int], keep_last: int = 0, need: str = NEED_LOGITS
    ) -> Forward:
        count = len(tokens)
        total = self._advance(count)
        key = (count, keep_last or count, need)
        call = self._bound
        if call is None or call.key != key:
            call = self._bind(key)
        call.ids[0] = tokens
        self._inputs.push()
        if self.device != "cpu":
            self._binding.synchronize_inputs()
        self._timed(self.session.run_with_iobinding, self._binding)
        if self.device != "cpu":
            self._binding.synchronize_outputs()
        self.length = total
        self.calls += 1
        self.bytes_to_host += call.host_bytes
        return call.result()

    def _bind(self, key: tuple[int, int, str]) -> _DeviceCall:
        call = self._calls.get(key)
        if call is None:
            call = _DeviceCall(key, self.spec, self.device, self.device_id)
            if len(self._calls) < MAX_KEPT_CALL_SHAPES:
                self._calls[key] = call
        io, binding = self.spec.io, self._binding
        self._logits_to_keep[0] = self._keep_sign * key[1]
        self._inputs.bind(io.input_ids, call.ids)
        for name in OUTPUTS:
            binding.bind_ortvalue_output(getattr(io, name), call.values[name])
        self._bound = call
        return call


class _DeviceCall:
    """The values one call shape binds: token ids on the host; of the outputs, those ``need``
    names on the host (numpy arrays onnxruntime copies into), the others on the device."""

    def __init__(
        self, key: tuple[int, int, str], spec: ModelSpec, device: str, device_id: int
    ) -> None:
        self.key = key
        count, keep, need = key
        self.ids = np.zeros((1, count), dtype=np.int64)
        self.values: dict[str, ort.OrtValue] = {}
        on_host = {
            NEED_LOGITS: {"logits"},
            NEED_PROBABILITIES: {"probabilities"},
            NEED_ARGMAX: {"argmax", "max_logit", "max_probability"},
        }[need]
        shapes = {
            "logits": ((1, keep, spec.vocab_size), np.float32),
            "probabilities": ((1, keep, spec.vocab_size), np.float32),
            "argmax": ((1, keep), np.int64),
            "max_logit": ((1, keep), np.float32),
            "max_probability": ((1, keep), np.float32),
        }
        self.host: dict[str, np.ndarray] = {}
        for name, (shape, dtype) in shapes.items():
            if name in on_host:
                self.host[name] = np.empty(shape, dtype)
                self.values[name] = ort.OrtValue.ortvalue_from_numpy(self.host[name])
            else:
                self.values[name] = ort.OrtValue.ortvalue_from_shape_and_type(
                    shape, dtype, device, device_id
                )

        self.host_bytes = sum(array.nbytes for array in self.host.values())

    def result(self) -> Forward:
        rows = {name: array[0] for name, array in self.host.items()}
        argmax = rows.pop("argmax", None)
        return Forward(
            logits=rows.pop("logits", None),
            argmax=None if argmax is None else argmax.tolist(),
            **rows,
        )

"""CUDA's rule for host inputs, on the CPU: the device engines' CPU twin as a GPU would run it.

On CUDA, onnxruntime copies a host (NumPy-backed) value bound as an input to the device when it
is BOUND (`IOBinding.cc`, `CopyOneInputAcrossDevices`); `run_with_iobinding` does not copy it
again, so writing the host array after binding changes nothing the GPU sees. On the CPU a bound
host value *is* the array, so the plain CPU twin cannot see a backend that writes inputs after
binding them. Within `cuda_on_cpu()`:

- a session asked for with CUDAExecutionProvider first runs on the CPU provider but says it runs
  on CUDA (`get_providers`), and this machine counts one GPU: the runtime takes its CUDA path;
- such a session's IOBinding copies a host value bound as an input (`bind_ortvalue_input` of a
  NumPy-backed OrtValue, `bind_cpu_input`, `bind_input` with device "cpu") when it is bound, and
  every later run reads that copy until the input is bound again;
- "cuda" memory (`ortvalue_from_shape_and_type(..., "cuda")`, `ortvalue_from_numpy(...,
  "cuda")`, `bind_input` / `bind_output` with device "cuda") is CPU memory onnxruntime
  allocated, bound as it is: device-resident caches and outputs stay live, as on a GPU;
- host outputs are written by every run, as onnxruntime copies device results into them.

Every value stays a real onnxruntime value run by real onnxruntime sessions: only where the data
lives at bind time changes. Stricter than CUDA in one way: inputs a CUDA kernel reads on the
host (GroupQueryAttention's total_sequence_length, Slice's starts) are copied too, so a backend
must bind every host input again after writing it, or keep a device twin up to date.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

import numpy as np
import onnxruntime as ort

_from_numpy = ort.OrtValue.ortvalue_from_numpy
_from_shape = ort.OrtValue.ortvalue_from_shape_and_type
_io_binding = ort.InferenceSession.io_binding


def batched(bundle) -> bool:
    """Whether the bundle's cuda engine is the batched graph (else GroupQueryAttention's)."""
    from specrt.bundle import read_manifest

    return read_manifest(bundle).models["target"].engines["cuda"].cache == "batched"


def _device_value(value: ort.OrtValue) -> ort.OrtValue:
    value._emulated_device = True  # memory onnxruntime allocated: bound as it is
    return value


def _on_device_from_numpy(array: np.ndarray, device_type: str = "cpu", device_id: int = 0, *a):
    if device_type != "cuda":
        return _from_numpy(array, device_type, device_id, *a)
    value = _device_value(_from_shape(array.shape, array.dtype, "cpu", 0))
    value.update_inplace(np.ascontiguousarray(array))  # a copy, as the upload is
    return value


def _on_device_from_shape(shape, element_type, device_type: str = "cpu", device_id: int = 0, *a):
    if device_type != "cuda":
        return _from_shape(shape, element_type, device_type, device_id, *a)
    return _device_value(_from_shape(shape, element_type, "cpu", 0))


def _snapshot(array: np.ndarray) -> ort.OrtValue:
    """What the device holds after the copy at bind time."""
    return _on_device_from_numpy(np.array(array, copy=True), "cuda")


class CopyAtBind(ort.IOBinding):
    """An IOBinding that copies host inputs when they are bound, as CUDA's does."""

    def bind_ortvalue_input(self, name, ortvalue):
        if not getattr(ortvalue, "_emulated_device", False):
            ortvalue = _snapshot(ortvalue.numpy())
        super().bind_ortvalue_input(name, ortvalue)

    def bind_cpu_input(self, name, arr_on_cpu):
        super().bind_ortvalue_input(name, _snapshot(arr_on_cpu))

    def bind_input(self, name, device_type, device_id, element_type, shape, buffer_ptr):
        if device_type == "cuda":
            super().bind_input(name, "cpu", 0, element_type, shape, buffer_ptr)
            return
        dtype = np.dtype(element_type)
        size = int(np.prod(shape)) * dtype.itemsize
        host = np.frombuffer((ctypes.c_char * size).from_address(buffer_ptr), dtype)
        super().bind_ortvalue_input(name, _snapshot(host.reshape(shape)))

    def bind_output(self, name, device_type="cpu", device_id=0, *args, **kwargs):
        device_type = "cpu" if device_type == "cuda" else device_type
        super().bind_output(name, device_type, 0, *args, **kwargs)


CUDA = "CUDAExecutionProvider"
_session_init = ort.InferenceSession.__init__
_get_providers = ort.InferenceSession.get_providers
_available = ort.get_available_providers


def _session(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kw):
    first = (providers or [None])[0]
    self._emulated_cuda = (first if isinstance(first, str) else (first or [None])[0]) == CUDA
    if self._emulated_cuda:
        providers, provider_options = ["CPUExecutionProvider"], None
    _session_init(self, path_or_bytes, sess_options, providers, provider_options, **kw)


def _providers(self):
    if getattr(self, "_emulated_cuda", False):
        return [CUDA, "CPUExecutionProvider"]
    return _get_providers(self)


def _binding(self):
    return CopyAtBind(self) if getattr(self, "_emulated_cuda", False) else ort.IOBinding(self)


@contextlib.contextmanager
def cuda_on_cpu(monkeypatch) -> Iterator[None]:
    """Within it, sessions asked for on CUDA bind as CUDA's do, over "cuda" memory on the CPU."""
    from specrt.backends import session

    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(_on_device_from_numpy))
    monkeypatch.setattr(
        ort.OrtValue, "ortvalue_from_shape_and_type", staticmethod(_on_device_from_shape)
    )
    monkeypatch.setattr(ort.InferenceSession, "__init__", _session)
    monkeypatch.setattr(ort.InferenceSession, "get_providers", _providers)
    monkeypatch.setattr(ort.InferenceSession, "io_binding", _binding)
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, *_available()])
    monkeypatch.setattr(session, "cuda_devices", lambda: 1)
    yield

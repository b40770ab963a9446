"""TensorRT, two ways, both from the bundle's portable graph (TensorRT takes standard ops only):

* onnxruntime's TensorRT execution provider: `ep_options` gives its provider options, with two
  optimisation profiles generated from the manifest (decode/verify: 1..K+1 new positions on a
  past of 0..max_length; prefill: up to a prompt chunk), float16, and its engine cache inside the
  bundle (``ROLE/tensorrt-ep-cache``). `select.open_decoder` uses them when the first provider
  asked for is ``TensorrtExecutionProvider``.
* serialized plans built by ``specrt build --tensorrt`` (`specrt.export.tensorrt_plans`) and run
  by `PlanDecoder` with the ``tensorrt`` runtime and CuPy device buffers. A plan only runs on the
  GPU model and TensorRT version it was built with: `check_plan` refuses any other with the
  command that rebuilds it.

Both need the ``tensorrt`` extra on a machine with an NVIDIA GPU; without it they fail with a
message saying so. The runtime never imports tensorrt or cupy unless a plan is run.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specrt.backends.base import (
    NEED_ARGMAX,
    NEED_LOGITS,
    NEED_PROBABILITIES,
    PREFILL_CHUNK,
    DecoderBase,
    Forward,
)
from specrt.bundle import ModelSpec
from specrt.errors import BundleError, InvalidInputError

TENSORRT_PROVIDER = "TensorrtExecutionProvider"
TENSORRT_ENGINE = "tensorrt"  # the key of the serialized plans in ModelSpec.engines
EP_CACHE = "tensorrt-ep-cache"
MAX_NEW_POSITIONS = 65  # a verification pass: K + 1 with K up to config.MAX_DRAFT_TOKENS
MISSING = (
    "TensorRT is not installed here: on a machine with an NVIDIA GPU, pip install "
    "'specrt[tensorrt]' (the tensorrt and cupy packages)"
)


def profiles(
    spec: ModelSpec, max_length: int, role: str, hidden: int = 0
) -> list[dict[str, tuple]]:
    """Two optimisation profiles for the portable graph's inputs, each {input: (min, opt, max)}:
    decode/verify (1..K+1 new positions; opt 1 for the draft, 5 for the target: K = 4) and
    prefill (up to a prompt chunk). The past runs from 0 to max_length - 1 positions in both.
    ``hidden``: the width of an EAGLE head's input features (`graph_input_width`)."""
    io = spec.io
    past_max = max_length - 1
    decode_opt = 1 if role == "draft" else 5
    shapes = []
    for new_max, new_opt in (
        (MAX_NEW_POSITIONS, decode_opt),
        (PREFILL_CHUNK, PREFILL_CHUNK // 2),
    ):
        new_max = min(new_max, max_length)
        new_opt = min(new_opt, new_max)
        past_opt = max(0, min(256, max_length - new_opt))  # the mask's opt fits its max
        profile = {io.input_ids: ((1, 1), (1, new_opt), (1, new_max))}
        if io.attention_mask:
            profile[io.attention_mask] = ((1, 1), (1, past_opt + new_opt), (1, max_length))
        if io.position_ids:
            profile[io.position_ids] = ((1, 1), (1, new_opt), (1, new_max))
        if io.hidden_states:
            profile[io.hidden_states] = ((1, 1, hidden), (1, new_opt, hidden), (1, new_max, hidden))
        for name in [*io.past_keys, *io.past_values]:
            dims = (spec.num_kv_heads, spec.head_dim)
            profile[name] = (
                (1, dims[0], 0, dims[1]),
                (1, dims[0], past_opt, dims[1]),
                (1, dims[0], past_max, dims[1]),
            )
        shapes.append(profile)
    return shapes


def ep_options(spec: ModelSpec, bundle_root: Path, role: str, max_length: int) -> dict[str, str]:
    """onnxruntime's TensorRT provider options for ``role``'s portable graph: float16, the
    engine cache inside the bundle, and the profiles above as explicit shape ranges (one name
    given several times makes several profiles)."""
    options = {
        "trt_fp16_enable": "True",
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(bundle_root / role / EP_CACHE),
        "trt_timing_cache_enable": "True",
    }
    hidden = graph_input_width(bundle_root / spec.path, spec.io.hidden_states)
    for index, key in enumerate(("min", "opt", "max")):
        options[f"trt_profile_{key}_shapes"] = ",".join(
            f"{name}:{'x'.join(str(d) for d in shape[index])}"
            for profile in profiles(spec, max_length, role, hidden)
            for name, shape in profile.items()
        )
    return options


def graph_input_width(graph: Path, name: str | None) -> int:
    """The last dimension of the graph's input ``name`` (0: none named), read by onnxruntime
    on the CPU without optimising (the runtime has no onnx package; a head's graph is small)."""
    if not name:
        return 0
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    [found] = [value for value in session.get_inputs() if value.name == name]
    return int(found.shape[-1])


def gpu_identity() -> dict[str, str]:
    """The GPU model and TensorRT version a plan is built for (nvidia-smi and tensorrt)."""
    try:
        import tensorrt
    except ImportError as exc:
        raise InvalidInputError(MISSING) from exc
    if shutil.which("nvidia-smi") is None:
        raise InvalidInputError("nvidia-smi is not here: TensorRT plans need an NVIDIA GPU")
    query = ["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader", "-i", "0"]
    done = subprocess.run(query, capture_output=True, text=True)
    fields = done.stdout.strip().split(", ")
    if done.returncode != 0 or len(fields) != 2:  # no driver, no device (a container without)
        said = (done.stderr or done.stdout).strip().splitlines()
        raise InvalidInputError(
            f"nvidia-smi finds no GPU here ({said[0] if said else f'exit {done.returncode}'}): "
            "TensorRT plans need an NVIDIA GPU and its driver"
        )
    name, capability = fields
    return {"tensorrt": tensorrt.__version__, "gpu": name, "compute_capability": capability}


def check_plan(built_for: dict[str, str], here: dict[str, str], role: str) -> None:
    """Refuse a plan built for another GPU model or TensorRT version."""
    for key, what in (
        ("gpu", "GPU"),
        ("compute_capability", "compute capability"),
        ("tensorrt", "TensorRT version"),
    ):
        if built_for.get(key) != here.get(key):
            raise BundleError(
                f"{role}: the TensorRT plan was built for {what} {built_for.get(key)!r}, this "
                f"machine has {here.get(key)!r}; plans run only where they were built: rebuild "
                "them here with `specrt build --bundle DIR --tensorrt`"
            )


class PlanDecoder(DecoderBase):
    """Runs a serialized TensorRT plan of the portable graph (cache fed back each call).

    The cache lives on the GPU in two buffers per layer and kind, used alternately: a call reads
    ``past`` from one as a dense ``[1, heads, length, head_dim]`` tensor and writes ``present``
    (past + new) into the other, so no call copies the cache; a rollback repacks the kept prefix
    once (the dense layout of a shorter length differs). Only what ``need`` names comes back."""

    def __init__(self, plan: Path, spec: ModelSpec, vocab_size: int, role: str, max_length: int):
        # No onnxruntime session: DecoderBase's __init__ is skipped, its prefill and checks kept.
        try:
            import cupy
            import tensorrt
        except ImportError as exc:
            raise InvalidInputError(MISSING) from exc
        self.spec, self.role, self.vocab_size = spec, role, vocab_size
        self.model_max_positions = spec.max_positions
        self.max_positions = min(spec.max_positions, max_length or spec.max_positions)
        self.run_time_s = 0.0
        self.cp = cupy
        logger = tensorrt.Logger(tensorrt.Logger.WARNING)
        engine = tensorrt.Runtime(logger).deserialize_cuda_engine(plan.read_bytes())
        if engine is None:
            raise BundleError(f"{role}: TensorRT cannot load {plan}; rebuild it (specrt build)")
        self._engine, self._context = engine, engine.create_execution_context()
        # Blocking: it waits for cupy's default stream, where the inputs, the mask and a
        # rollback's repacking are written (a non-blocking one could read them half written)
        self._stream = cupy.cuda.Stream(non_blocking=False)
        self._profile = -1
        shape = (spec.num_kv_heads, self.max_positions, spec.head_dim)
        layers = 2 * spec.num_layers
        self._buffers = [[cupy.zeros(shape, np.float32) for _ in range(layers)] for _ in (0, 1)]
        self._current = 0  # which of the two holds the valid past
        self.length = 0
        self._positions = np.arange(self.max_positions, dtype=np.int64)[None]

    @property
    def cache_bytes_per_row(self) -> int:
        """Both buffers, float32 whatever the plan's dtype."""
        spec = self.spec
        return 2 * 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * self.max_positions * 4

    def reset(self) -> None:
        self.length = 0

    def rollback(self, length: int) -> None:
        if length >= self.length:
            return
        heads, dim = self.spec.num_kv_heads, self.spec.head_dim
        source, target = self._buffers[self._current], self._buffers[1 - self._current]
        for old, new in zip(source, target):  # repack the kept prefix densely
            dense = old.ravel()[: heads * self.length * dim].reshape(heads, self.length, dim)
            new.ravel()[: heads * length * dim] = dense[:, :length].ravel()
        self._current = 1 - self._current
        self.length = length

    def forward(
        self, tokens: Sequence[int], keep_last: int = 0, need: str = NEED_LOGITS
    ) -> Forward:
        cp, io, ctx = self.cp, self.spec.io, self._context
        past, count = self.length, len(tokens)
        self._check_room(past, count)
        profile = 1 if count > MAX_NEW_POSITIONS else 0
        if profile != self._profile:
            ctx.set_optimization_profile_async(profile, self._stream.ptr)
            self._profile = profile
        feeds = {io.input_ids: cp.asarray(np.asarray([tokens], dtype=np.int64))}
        if io.attention_mask:
            feeds[io.attention_mask] = cp.ones((1, past + count), dtype=np.int64)
        if io.position_ids:
            feeds[io.position_ids] = cp.asarray(self._positions[:, past : past + count])
        heads, dim = self.spec.num_kv_heads, self.spec.head_dim
        reads, writes = self._buffers[self._current], self._buffers[1 - self._current]
        names = [*io.past_keys, *io.past_values]
        outputs = [*io.present_keys, *io.present_values]
        for name, buffer in zip(names, reads):
            feeds[name] = buffer.ravel()[: heads * past * dim].reshape(1, heads, past, dim)
        for name, array in feeds.items():
            if not ctx.set_input_shape(name, array.shape):  # outside every profile: not raised
                raise BundleError(
                    f"{self.role}: the TensorRT plan takes no {name} of shape "
                    f"{tuple(array.shape)} (profile {profile}); it was built for other lengths "
                    "than the manifest says: rebuild it with `specrt build --bundle DIR --tensorrt`"
                )
            ctx.set_tensor_address(name, array.data.ptr)
        total = past + count
        for name, buffer in zip(outputs, writes):
            present = buffer.ravel()[: heads * total * dim]
            ctx.set_tensor_address(name, present.data.ptr)
        logits = cp.empty((1, count, self.spec.vocab_size), dtype=np.float32)
        ctx.set_tensor_address(io.logits, logits.data.ptr)
        started = time.perf_counter()
        if not ctx.execute_async_v3(self._stream.ptr):
            raise BundleError(f"{self.role}: TensorRT failed to run the plan")
        self._stream.synchronize()
        self.run_time_s += time.perf_counter() - started
        self._current = 1 - self._current
        self.length = total
        rows = logits[0, count - (keep_last or count) :, : self.vocab_size]
        if need == NEED_ARGMAX:
            best = rows.argmax(axis=-1)
            top = rows.max(axis=-1)
            shifted = cp.exp(rows - top[:, None]).sum(axis=-1)
            return Forward(
                None,
                argmax=cp.asnumpy(best).tolist(),
                max_logit=cp.asnumpy(top),
                max_probability=cp.asnumpy(1.0 / shifted),
            )
        if need == NEED_PROBABILITIES:
            soft = cp.exp(rows - rows.max(axis=-1, keepdims=True))
            return Forward(None, probabilities=cp.asnumpy(soft / soft.sum(-1, keepdims=True)))
        return Forward(cp.asnumpy(rows))

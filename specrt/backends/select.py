"""Which of a model's graphs runs for the requested providers, and the decoder that runs it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import onnxruntime as ort

from specrt.backends.base import Decoder
from specrt.backends.batched import BatchedDecoder
from specrt.backends.device import DeviceDecoder
from specrt.backends.device_rows import DeviceRowsDecoder
from specrt.backends.in_place import InPlaceDecoder
from specrt.backends.portable import PortableDecoder, PortableRowsDecoder
from specrt.backends.session import create_session, default_providers, provider_names
from specrt.backends.tensorrt import (
    TENSORRT_ENGINE,
    TENSORRT_PROVIDER,
    PlanDecoder,
    check_plan,
    ep_options,
    gpu_identity,
)
from specrt.bundle import CUDA_ENGINE, ONNXRUNTIME_ENGINE, ModelSpec
from specrt.errors import InvalidInputError

# "auto": on the CPU provider each model's onnxruntime engine, on the CUDA provider its cuda
# engine, where the bundle has one, else its portable graph; the others insist on one ("cuda" on
# the CPU provider runs the cuda engine's graph on the CPU, as a check of it).
ENGINE_CHOICES = ("auto", "portable", ONNXRUNTIME_ENGINE, CUDA_ENGINE, TENSORRT_ENGINE)
DEFAULT_MAX_LENGTH = 8192  # positions of preallocated KV cache per engine model
CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
log = logging.getLogger("specrt")


def open_decoder(
    bundle_root: Path,
    spec: ModelSpec,
    role: str,
    vocab_size: int,
    engine: str = "auto",
    providers: Sequence[str | tuple[str, dict]] | None = None,
    threads: int | None = None,
    max_length: int | None = DEFAULT_MAX_LENGTH,
    max_batch: int = 1,
) -> Decoder:
    """Open ``role``'s graph chosen by ``engine`` for ``providers`` and wrap it in its decoder
    (``max_batch``: rows a batched engine holds; other decoders run one row)."""
    if not providers:  # the CPU engine asked for by name runs where it can: on the CPU
        providers = [CPU] if engine == ONNXRUNTIME_ENGINE else default_providers()
    providers = list(providers)
    names = provider_names(providers)
    graph = select_graph(spec, role, engine, names, str(bundle_root))
    if engine == TENSORRT_ENGINE:
        built_for = spec.engines[TENSORRT_ENGINE].built_for
        check_plan(built_for, gpu_identity(), role)
        limit = int(built_for.get("max_length", spec.max_positions))  # the profiles' range
        length = min(max_length or limit, limit)
        return PlanDecoder(bundle_root / graph.path, graph, vocab_size, role, length)
    if names[0] == TENSORRT_PROVIDER:  # the portable graph, compiled by the provider
        options = ep_options(graph, bundle_root, role, max_length or spec.max_positions)
        given = providers[0][1] if isinstance(providers[0], tuple) else {}
        providers = [(TENSORRT_PROVIDER, {**options, **given}), *providers[1:]]
        max_batch = 1  # its optimisation profiles are built for one row
    session = create_session(bundle_root / graph.path, threads=threads, providers=providers)
    wanted = names[0]
    if wanted in (CUDA, TENSORRT_PROVIDER) and session.get_providers()[0] != wanted:
        # onnxruntime lists its GPU providers whether or not their libraries load, and falls
        # back to the CPU with a warning: the device engines would then fail far from here
        raise InvalidInputError(
            f"{role}: onnxruntime could not start {wanted} (it runs on "
            f"{session.get_providers()[0]}: the CUDA libraries it needs did not load; see its "
            "message above, and LD_LIBRARY_PATH); fix them, or ask for CPUExecutionProvider"
        )
    if graph.io.argmax:  # a device engine: its cache lives where the provider computes
        device, device_id = engine_device(providers)
        if graph.cache == "batched":
            return DeviceRowsDecoder(
                session, graph, vocab_size, role, max_length, max_batch, device, device_id
            )
        return DeviceDecoder(session, graph, vocab_size, role, max_length, device, device_id)
    return make_decoder(session, graph, vocab_size, role, max_length, max_batch)


def engine_device(providers: Sequence[str | tuple[str, dict]]) -> tuple[str, int]:
    """Where a device engine's cache and outputs live for ``providers``: ("cuda", its
    ``device_id`` option) on the CUDA provider, given by name or with options; else the CPU."""
    first = providers[0]
    name, options = (first, {}) if isinstance(first, str) else first
    if name != CUDA:
        return "cpu", 0
    return "cuda", int(options.get("device_id", 0))


# Portable graphs that do not mask a padded past exactly (optimum's Gemma 2 and Gemma 3 graphs:
# a past padded with zeros moved their logits by 0.02 and 0.86), so their rows cannot share a
# call: one row each.
ONE_ROW_PORTABLE = ("gemma2", "gemma3_text")


def make_decoder(
    session: ort.InferenceSession,
    spec: ModelSpec,
    vocab_size: int,
    role: str,
    max_length: int | None = None,
    max_batch: int = 1,
) -> Decoder:
    """The decoder class the graph's cache contract (``spec.cache``) needs, on the host
    (``max_batch``: rows a batched engine holds)."""
    if spec.cache == "batched":
        return BatchedDecoder(session, spec, vocab_size, role, max_length, max_batch)
    if spec.cache == "in_place":
        return InPlaceDecoder(session, spec, vocab_size, role, max_length)
    one_row = spec.model_type in ONE_ROW_PORTABLE
    if spec.io.features or spec.io.hidden_states:  # `EagleDraft` reads a rows decoder's features
        rows = 1 if one_row else max_batch
        return PortableRowsDecoder(session, spec, vocab_size, role, max_length, rows)
    if max_batch > 1 and not one_row:
        return PortableRowsDecoder(session, spec, vocab_size, role, max_length, max_batch)
    return PortableDecoder(session, spec, vocab_size, role, max_length)


def select_graph(
    spec: ModelSpec, role: str, engine: str, providers: list[str], bundle: str = "DIR"
) -> ModelSpec:
    """The model as seen through the graph that runs: an engine or the portable graph
    (``bundle``: its path, for the messages)."""
    if engine not in ENGINE_CHOICES:
        raise InvalidInputError(f"engine={engine!r}: use one of {', '.join(ENGINE_CHOICES)}")
    provider = provider_names(providers)[0]
    portable = spec.cache == "concat"  # else a --no-portable bundle: its main graph is an engine
    if provider == TENSORRT_PROVIDER and engine in ("auto", "portable"):
        if not portable:  # its graph is an engine of contrib ops and a batched cache
            raise InvalidInputError(
                f"the bundle's {role} has no portable graph (exported with --no-portable), "
                "which is what the TensorRT provider compiles: export it again without "
                "--no-portable, or use the CUDA provider"
            )
        return spec  # what TensorRT compiles: standard ops only
    if engine == "auto":
        wanted = {CPU: ONNXRUNTIME_ENGINE, CUDA: CUDA_ENGINE}.get(provider)
        if wanted in spec.engines:
            return spec.engine_view(wanted)
        if provider == CUDA:
            log.warning(
                "%s: the bundle has no cuda engine, so the portable graph runs on CUDA (its KV "
                "cache crosses PCIe every call); build one: specrt build --bundle %s --device "
                "cuda",
                role,
                bundle,
            )
        elif provider == CPU and spec.engines:  # built for a GPU, run here on the CPU
            log.warning(
                "%s: the bundle has no onnxruntime engine for the CPU, so %s runs here; build "
                "one: specrt build --bundle %s --device cpu",
                role,
                "the portable graph" if portable else "its cuda engine (float16, slow on a CPU)",
                bundle,
            )
        return spec
    if engine == "portable":
        if not portable:
            raise InvalidInputError(
                f"the bundle's {role} has no portable graph (it was exported with "
                f"--no-portable); use engine 'auto' or one of its engines: "
                f"{', '.join(spec.engines)}"
            )
        return spec
    if engine not in spec.engines:
        how = {CUDA_ENGINE: " --device cuda", TENSORRT_ENGINE: " --tensorrt"}.get(engine, "")
        raise InvalidInputError(
            f"the bundle's {role} has no {engine} engine (`specrt build --bundle {bundle}{how}` "
            "builds one); use engine 'auto' or 'portable'"
        )
    if engine == CUDA_ENGINE and provider == CPU:
        log.warning(
            "%s: the cuda engine runs on the CPU here (no CUDA provider): a check of the graph, "
            "float16 and slow",
            role,
        )
    if engine == ONNXRUNTIME_ENGINE and provider != CPU:
        # Its in-place cache lives in host memory: on a GPU every call would copy it across.
        raise InvalidInputError(
            f"the onnxruntime engine keeps its KV cache in host memory and runs on the CPU "
            f"provider only (asked for {provider}); use engine 'cuda', 'portable' or 'auto' on GPU"
        )
    return spec.engine_view(engine)

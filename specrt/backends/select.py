"""Which of a model's graphs runs for the requested providers, and the decoder that runs it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnxruntime as ort

from specrt.backends.base import Decoder
from specrt.backends.in_place import InPlaceDecoder
from specrt.backends.portable import PortableDecoder
from specrt.backends.session import create_session, default_providers
from specrt.bundle import ONNXRUNTIME_ENGINE, ModelSpec
from specrt.errors import InvalidInputError

# "auto": each model's onnxruntime engine where the bundle has one and the provider suits it,
# else its portable graph; the others insist on one.
ENGINE_CHOICES = ("auto", "portable", ONNXRUNTIME_ENGINE)
DEFAULT_MAX_LENGTH = 8192  # positions of preallocated KV cache per engine model


def open_decoder(
    bundle_root: Path,
    spec: ModelSpec,
    role: str,
    vocab_size: int,
    engine: str = "auto",
    providers: Sequence[str] | None = None,
    threads: int | None = None,
    max_length: int | None = DEFAULT_MAX_LENGTH,
) -> Decoder:
    """Open ``role``'s graph chosen by ``engine`` for ``providers`` and wrap it in its decoder."""
    providers = list(providers or default_providers())
    graph = select_graph(spec, role, engine, providers)
    session = create_session(bundle_root / graph.path, threads=threads, providers=providers)
    return make_decoder(session, graph, vocab_size, role, max_length)


def make_decoder(
    session: ort.InferenceSession,
    spec: ModelSpec,
    vocab_size: int,
    role: str,
    max_length: int | None = None,
) -> Decoder:
    """The decoder class the graph's cache contract (``spec.cache``) needs."""
    if spec.cache == "in_place":
        return InPlaceDecoder(session, spec, vocab_size, role, max_length)
    return PortableDecoder(session, spec, vocab_size, role, max_length)


def select_graph(spec: ModelSpec, role: str, engine: str, providers: list[str]) -> ModelSpec:
    """The model as seen through the graph that runs: its onnxruntime engine or the portable one."""
    if engine not in ENGINE_CHOICES:
        raise InvalidInputError(f"engine={engine!r}: use one of {', '.join(ENGINE_CHOICES)}")
    has_engine = ONNXRUNTIME_ENGINE in spec.engines
    # The engine's in-place cache lives in host memory; on a GPU provider every call would copy
    # it across, so auto takes the portable graph there.
    on_cpu = providers[0] == "CPUExecutionProvider"
    if engine == "portable" or (engine == "auto" and not (has_engine and on_cpu)):
        return spec
    if not on_cpu:
        raise InvalidInputError(
            f"the onnxruntime engine keeps its KV cache in host memory and runs on the CPU "
            f"provider only (asked for {providers[0]}); use engine 'portable' or 'auto' on GPU"
        )
    if not has_engine:
        raise InvalidInputError(
            f"the bundle's {role} has no onnxruntime engine (`specrt export` builds one for "
            "every supported architecture); use engine 'auto' or 'portable', or re-export the "
            "bundle"
        )
    return spec.engine_view(ONNXRUNTIME_ENGINE)

"""`specrt build --tensorrt`: serialized TensorRT plans of a bundle's portable graphs.

Built with TensorRT's own Python API (OnnxParser, builder config with FP16, two optimisation
profiles from `specrt.backends.tensorrt.profiles`: decode/verify and prefill, each tuned at its
typical shape), recorded in the manifest as engine "tensorrt" with the TensorRT version and GPU
they were built for, and swapped into the bundle like any other rebuild. Needs the ``tensorrt``
extra and an NVIDIA GPU; without them it stops before touching the bundle, saying so.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from specrt.backends.select import DEFAULT_MAX_LENGTH
from specrt.backends.tensorrt import MISSING, TENSORRT_ENGINE, gpu_identity, profiles
from specrt.bundle import EngineSpec, Manifest, read_manifest, verify_checksums, write_manifest
from specrt.checksums import sha256_file
from specrt.errors import ExportError, InvalidInputError
from specrt.staging import publish, staging


def build_plans(bundle_dir: str | Path, log=lambda message: None) -> Manifest:
    try:
        import tensorrt
    except ImportError as exc:
        raise ExportError(MISSING) from exc
    try:
        identity = gpu_identity()
    except InvalidInputError as exc:
        raise ExportError(str(exc)) from exc
    root = Path(bundle_dir)
    manifest = read_manifest(root)
    verify_checksums(manifest, root)
    for role, spec in manifest.models.items():
        if spec.cache != "concat":
            raise ExportError(
                f"the bundle's {role} has no portable graph (exported with --no-portable), and "
                "TensorRT takes only that one: re-export with the portable graph"
            )
    with staging(root, "build") as scratch:
        shutil.copytree(root, scratch, dirs_exist_ok=True)
        for role, spec in manifest.models.items():
            old = spec.engines.pop(TENSORRT_ENGINE, None)
            if old is not None:
                shutil.rmtree((scratch / old.path).parent, ignore_errors=True)
            max_length = min(spec.max_positions, DEFAULT_MAX_LENGTH)
            log(f"building the {role} TensorRT plan (positions up to {max_length})")
            plan = scratch / role / TENSORRT_ENGINE / "model.plan"
            plan.parent.mkdir(parents=True, exist_ok=True)
            plan.write_bytes(
                _build(tensorrt, scratch / spec.path, profiles(spec, max_length, role))
            )
            spec.engines[TENSORRT_ENGINE] = EngineSpec(
                path=str(plan.relative_to(scratch)),
                files={str(plan.relative_to(scratch)): sha256_file(plan)},
                io=spec.io,
                vocab_size=spec.vocab_size,
                cache="concat",
                precision="float16",
                provider="TensorRT",
                dtype="float32",  # the graph's inputs and outputs; FP16 inside
                built_for={**identity, "max_length": str(max_length)},
            )
        write_manifest(scratch, manifest)
        publish(scratch, root)
    return manifest


def _build(trt, onnx_path: Path, shapes: list[dict[str, tuple]]) -> bytes:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch: the only mode of TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ExportError(f"TensorRT cannot parse {onnx_path}: {errors[:500]}")
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16)
    for profile_shapes in shapes:
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in profile_shapes.items():
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError(f"TensorRT could not build a plan of {onnx_path} (see its log above)")
    return bytes(serialized)

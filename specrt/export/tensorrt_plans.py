"""`specrt build --tensorrt`: serialized TensorRT plans of a bundle's portable graphs.

Built with TensorRT's own Python API from a float16 copy of the portable graph (inputs and
outputs kept float32, and each norm's mean of squares), as a strongly typed network: the
only kind TensorRT 11 builds (it removed ``BuilderFlag.FP16``: the graph's types are the
precision), and a flag TensorRT 10 takes. Two optimisation profiles from
`specrt.backends.tensorrt.profiles` (decode/verify and prefill, each tuned at its typical shape);
recorded in the manifest as engine "tensorrt" with the TensorRT version and GPU they were built
for, and swapped into the bundle like any other rebuild. Needs the ``tensorrt`` extra and an
NVIDIA GPU; without them it stops before touching the bundle, saying so.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from specrt.backends.select import DEFAULT_MAX_LENGTH
from specrt.backends.tensorrt import MISSING, TENSORRT_ENGINE, gpu_identity, profiles
from specrt.bundle import EngineSpec, Manifest, read_manifest, write_manifest
from specrt.checksums import sha256_file, verify_checksums
from specrt.errors import ExportError, InvalidInputError
from specrt.export.destination import refuse_mount_point
from specrt.staging import publish, staging


def build_plans(bundle_dir: str | Path, log=lambda message: None) -> Manifest:
    root = Path(bundle_dir)
    manifest = read_manifest(root)
    refuse_mount_point(root, "--bundle")
    if manifest.models["draft"].eagle_head:
        raise ExportError(
            "TensorRT plans are not built for a bundle drafted for by an EAGLE head yet; its "
            "portable graphs run on onnxruntime's TensorRT provider (Python: providers="
            "['TensorrtExecutionProvider', 'CUDAExecutionProvider']), or build its cuda engines: "
            f"specrt build --bundle {bundle_dir} --device cuda"
        )
    try:
        import tensorrt
    except ImportError as exc:
        raise ExportError(MISSING) from exc
    try:
        identity = gpu_identity()
    except InvalidInputError as exc:
        raise ExportError(str(exc)) from exc
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
    # Strongly typed: TensorRT 10 needs the flag, 11 builds nothing else (and may drop the name)
    strong = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    network = builder.create_network(0 if strong is None else 1 << int(strong))
    parser = trt.OnnxParser(network, logger)
    with tempfile.TemporaryDirectory(dir=onnx_path.parent) as scratch:
        graph = float16_graph(onnx_path, Path(scratch) / "model.onnx")
        if not parser.parse_from_file(str(graph)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise ExportError(f"TensorRT cannot parse {graph}: {errors[:500]}")
    config = builder.create_builder_config()
    for profile_shapes in shapes:
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in profile_shapes.items():
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError(f"TensorRT could not build a plan of {onnx_path} (see its log above)")
    return bytes(serialized)


def float16_graph(source: Path, out: Path) -> Path:
    """A float16 copy of the float32 graph ``source`` at ``out`` (weights beside it), for a
    strongly typed build: inputs and outputs stay float32 (what `PlanDecoder` feeds and reads),
    and each norm's square, mean and root stay float32 (a square of an activation past 256
    overflows float16). onnxruntime's own converter, the one its float16 models come from."""
    import onnx
    from onnx.shape_inference import infer_shapes_path
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    # The converter types every tensor from shape inference; a path keeps graphs over 2 GB whole
    inferred = out.with_name("inferred.onnx")
    try:
        infer_shapes_path(str(source), str(inferred))
        model = onnx.load(str(inferred), load_external_data=False)
        onnx.load_external_data_for_model(model, str(source.parent))
    finally:
        inferred.unlink(missing_ok=True)
    converted = convert_float_to_float16(
        model,
        keep_io_types=True,
        disable_shape_infer=True,
        op_block_list=[*DEFAULT_OP_BLOCK_LIST, "Pow", "ReduceMean", "Sqrt", "Reciprocal"],
        node_block_list=_mean_square_adds(model.graph),
    )
    onnx.save_model(
        converted,
        str(out),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=out.name + ".data",
    )
    return out


def _mean_square_adds(graph) -> list[str]:
    """The nodes adding epsilon to a mean of squares (an RMSNorm's ``mean(x**2) + eps``): kept
    float32 with the ReduceMean before them and the Sqrt after."""
    means = {out for node in graph.node if node.op_type == "ReduceMean" for out in node.output}
    return [
        node.name
        for node in graph.node
        if node.op_type == "Add" and node.name and means.intersection(node.input)
    ]

"""TensorRT without TensorRT: the provider options and profiles generated from the manifest, the
refusal of a plan built elsewhere, clear errors where tensorrt or a GPU is missing, and what the
plan builder and the plan runner ask of TensorRT's Python API (a stand-in of that API records it:
TensorRT cannot be installed here)."""

from __future__ import annotations

import json
import shutil
import sys
import types

import numpy as np
import pytest
from click.testing import CliRunner

from specrt.backends.base import PREFILL_CHUNK
from specrt.backends.tensorrt import (
    MAX_NEW_POSITIONS,
    PlanDecoder,
    check_plan,
    ep_options,
    profiles,
)
from specrt.bundle import ModelIO, ModelSpec, read_manifest
from specrt.cli import main
from specrt.errors import BundleError


def parse(option: str) -> list[tuple[str, tuple[int, ...]]]:
    pairs = []
    for item in option.split(","):
        name, dims = item.split(":")
        pairs.append((name, tuple(int(d) for d in dims.split("x"))))
    return pairs


@pytest.mark.parametrize("role", ["target", "draft"])
def test_ep_options_carry_two_profiles_from_the_manifest(llama_bundle, tmp_path, role):
    spec = read_manifest(llama_bundle).models[role]
    options = ep_options(spec, tmp_path, role, max_length=100)
    assert options["trt_fp16_enable"] == "True"
    assert options["trt_engine_cache_path"] == str(tmp_path / role / "tensorrt-ep-cache")
    shapes = {key: parse(options[f"trt_profile_{key}_shapes"]) for key in ("min", "opt", "max")}
    names = [name for name, _ in shapes["min"]]
    inputs = [spec.io.input_ids, spec.io.attention_mask, spec.io.position_ids]
    inputs += spec.io.past_keys + spec.io.past_values
    assert sorted(names) == sorted(inputs * 2)  # every input, in two profiles
    assert [n for n, _ in shapes["opt"]] == names == [n for n, _ in shapes["max"]]
    for max_length in (100, 8, 2):
        options = ep_options(spec, tmp_path, role, max_length=max_length)
        ranges = [parse(options[f"trt_profile_{key}_shapes"]) for key in ("min", "opt", "max")]
        for (_, low), (_, opt), (_, high) in zip(*ranges):
            assert all(a <= b <= c for a, b, c in zip(low, opt, high)), (low, opt, high)
    decode, prefill = profiles(spec, 100, role)
    assert decode[spec.io.input_ids][1] == ((1, 1) if role == "draft" else (1, 5))
    assert decode[spec.io.input_ids][2] == (1, min(MAX_NEW_POSITIONS, 100))
    assert prefill[spec.io.input_ids][2] == (1, min(PREFILL_CHUNK, 100))
    past = decode[spec.io.past_keys[0]]
    assert past[0] == (1, spec.num_kv_heads, 0, spec.head_dim)
    assert past[2] == (1, spec.num_kv_heads, 99, spec.head_dim)
    assert decode[spec.io.attention_mask][2] == (1, 100)


def test_a_plan_from_another_gpu_or_version_is_refused():
    here = {"gpu": "NVIDIA H200", "compute_capability": "9.0", "tensorrt": "10.13.0"}
    check_plan(dict(here), here, "target")
    for key, other in (("gpu", "NVIDIA A100"), ("compute_capability", "8.0"), ("tensorrt", "10.1")):
        with pytest.raises(BundleError, match="specrt build --bundle DIR --tensorrt") as caught:
            check_plan({**here, key: other}, here, "draft")
        assert other in str(caught.value)


def test_build_tensorrt_without_tensorrt_changes_nothing(llama_bundle, tmp_path):
    pytest.importorskip("onnx")
    try:
        import tensorrt  # noqa: F401

        pytest.skip("tensorrt is installed here: this test is about machines without it")
    except ImportError:
        pass
    bundle = tmp_path / "bundle"
    shutil.copytree(llama_bundle, bundle)
    before = (bundle / "manifest.json").read_bytes()
    result = CliRunner().invoke(main, ["build", "--bundle", str(bundle), "--tensorrt"])
    assert result.exit_code == 1 and "TensorRT is not installed" in result.output
    assert "pip install 'specrt[tensorrt]'" in result.output
    assert (bundle / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def test_engine_tensorrt_needs_plans_and_tensorrt(llama_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(llama_bundle, bundle)
    args = ["generate", "--bundle", str(bundle), "--prompt", "a", "--engine", "tensorrt"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "--tensorrt" in result.output  # no plans: how to build them
    # a manifest that lists plans (as built on a GPU machine): this machine cannot run them
    plan = bundle / "target" / "tensorrt" / "model.plan"
    plan.parent.mkdir()
    plan.write_bytes(b"plan")
    data = json.loads((bundle / "manifest.json").read_text())
    from specrt.checksums import sha256_file

    entry = {
        "path": "target/tensorrt/model.plan",
        "files": {"target/tensorrt/model.plan": sha256_file(plan)},
        "io": data["models"]["target"]["io"],
        "vocab_size": data["models"]["target"]["vocab_size"],
        "cache": "concat",
        "precision": "float16",
        "provider": "TensorRT",
        "built_for": {"gpu": "NVIDIA H200", "tensorrt": "10.13.0", "compute_capability": "9.0"},
    }
    data["models"]["target"]["engines"]["tensorrt"] = entry
    data["models"]["draft"]["engines"]["tensorrt"] = {
        **entry,
        "path": "target/tensorrt/model.plan",
        "io": data["models"]["draft"]["io"],
    }
    (bundle / "manifest.json").write_text(json.dumps(data))
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "TensorRT is not installed" in result.output and "Traceback" not in result.output
    # the other engines of the same bundle still run
    assert CliRunner().invoke(main, [*args[:-1], "auto"]).exit_code == 0


def test_a_gpu_that_nvidia_smi_cannot_see_is_one_line(tmp_path):
    """A container with TensorRT installed but no driver: nvidia-smi is there and fails (a
    CalledProcessError traceback)."""
    import os
    import subprocess
    import sys

    (tmp_path / "tensorrt").mkdir()  # the package's presence is all that is asked of it here
    (tmp_path / "tensorrt" / "__init__.py").write_text('__version__ = "10.13.0"\n')
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: no driver' >&2\nexit 9\n")
    smi.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.getcwd()}"}
    env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
    code = "from specrt.backends.tensorrt import gpu_identity; gpu_identity()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "CalledProcessError" not in done.stderr
    assert "nvidia-smi finds no GPU here (NVIDIA-SMI has failed: no driver)" in done.stderr


def fake_tensorrt(calls: dict, shape_ok: bool = True) -> types.SimpleNamespace:
    """TensorRT 11's Python API as far as specrt uses it, recording what it is asked: no
    ``BuilderFlag.FP16`` (11 removed it), ``set_input_shape`` answering ``shape_ok``."""

    def record(name, result=None):
        return lambda *args: calls.setdefault(name, []).append(args) or result

    def parse_from_file(path):
        import onnx

        calls["parsed"] = onnx.load(path)  # read now: the builder's copy is gone after the build
        return True

    builder = types.SimpleNamespace(
        create_network=record("create_network"),
        create_builder_config=lambda: types.SimpleNamespace(
            set_flag=record("set_flag"), add_optimization_profile=record("profile")
        ),
        create_optimization_profile=lambda: types.SimpleNamespace(set_shape=record("set_shape")),
        build_serialized_network=record("build", b"plan"),
    )
    context = types.SimpleNamespace(
        set_optimization_profile_async=record("set_profile"),
        set_input_shape=record("set_input_shape", shape_ok),
        set_tensor_address=record("set_tensor_address"),
        execute_async_v3=record("execute", True),
    )
    engine = types.SimpleNamespace(create_execution_context=lambda: context)

    class Logger:
        WARNING = 2

        def __init__(self, severity: int) -> None:
            pass

    return types.SimpleNamespace(
        __version__="11.4.0.106",
        Logger=Logger,
        Builder=lambda logger: builder,
        OnnxParser=lambda network, logger: types.SimpleNamespace(parse_from_file=parse_from_file),
        NetworkDefinitionCreationFlag=types.SimpleNamespace(STRONGLY_TYPED=1),
        BuilderFlag=types.SimpleNamespace(TF32=6),
        Runtime=lambda logger: types.SimpleNamespace(deserialize_cuda_engine=lambda b: engine),
    )


def rms_norm_graph(path) -> None:
    """A float32 graph with an RMSNorm (x**2, mean, + eps, sqrt, divide) and a matmul."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = numpy_helper.from_array(np.ones((4, 4), np.float32), "weight")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    eps = numpy_helper.from_array(np.array(1e-6, np.float32), "eps")
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["squares"], name="norm/Pow"),
        helper.make_node("ReduceMean", ["squares"], ["mean"], name="norm/ReduceMean", axes=[-1]),
        helper.make_node("Add", ["mean", "eps"], ["var"], name="norm/Add"),
        helper.make_node("Sqrt", ["var"], ["rms"], name="norm/Sqrt"),
        helper.make_node("Div", ["x", "rms"], ["normed"], name="norm/Div"),
        helper.make_node("MatMul", ["normed", "weight"], ["logits"], name="head/MatMul"),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4])],
        [weights, two, eps],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def test_plans_are_strongly_typed_float16_builds(tmp_path):
    """TensorRT 11 has no FP16 builder flag (the build raised AttributeError): the plan is a
    strongly typed network of a float16 copy of the graph, float32 at its inputs and outputs
    and in the norm's mean of squares."""
    pytest.importorskip("onnx")
    from onnx import TensorProto

    from specrt.export.tensorrt_plans import _build

    rms_norm_graph(tmp_path / "model.onnx")
    calls: dict = {}
    shapes = [{"x": ((1, 4), (1, 4), (1, 4))}]
    assert _build(fake_tensorrt(calls), tmp_path / "model.onnx", shapes) == b"plan"
    assert calls["create_network"] == [(1 << 1,)]  # STRONGLY_TYPED
    assert "set_flag" not in calls  # no precision flags: the graph's types decide
    assert len(calls["profile"]) == 1 and calls["set_shape"] == [("x", (1, 4), (1, 4), (1, 4))]
    graph = calls["parsed"].graph
    types_of = {i.name: i.data_type for i in graph.initializer}
    types_of.update({v.name: v.type.tensor_type.elem_type for v in graph.value_info})
    types_of.update({v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]})
    assert types_of["weight"] == TensorProto.FLOAT16
    assert types_of["x"] == types_of["logits"] == TensorProto.FLOAT
    by_name = {node.name: node for node in graph.node}
    for name in ("norm/Pow", "norm/ReduceMean", "norm/Add", "norm/Sqrt"):
        assert all(types_of.get(out) == TensorProto.FLOAT for out in by_name[name].output), name
    assert types_of[by_name["head/MatMul"].output[0]] == TensorProto.FLOAT16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # the copy is gone


def fake_cupy() -> types.ModuleType:
    """CuPy on the host: NumPy arrays with cupy's ``.data.ptr``."""

    class DeviceArray(np.ndarray):
        @property
        def data(self):
            return types.SimpleNamespace(ptr=self.ctypes.data)

    def device(make):
        return lambda *args, **kwargs: np.asarray(make(*args, **kwargs)).view(DeviceArray)

    cupy = types.ModuleType("cupy")
    cupy.asarray, cupy.zeros = device(np.asarray), device(np.zeros)
    cupy.ones, cupy.empty = device(np.ones), device(np.zeros)
    cupy.exp, cupy.asnumpy = np.exp, np.asarray
    stream = types.SimpleNamespace(ptr=0, synchronize=lambda: None)
    cupy.cuda = types.SimpleNamespace(Stream=lambda non_blocking: stream)
    return cupy


def test_a_shape_outside_the_plan_is_a_clear_error(tmp_path, monkeypatch):
    """set_input_shape answers False for a shape outside every profile (it raises nothing): the
    plan then ran on stale shapes. Now it is refused, naming the input and its shape."""
    calls: dict = {}
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(calls, shape_ok=False))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    io = ModelIO(
        input_ids="input_ids",
        attention_mask="attention_mask",
        position_ids="position_ids",
        past_keys=["past.0.key"],
        past_values=["past.0.value"],
        logits="logits",
        present_keys=["present.0.key"],
        present_values=["present.0.value"],
    )
    spec = ModelSpec(
        path="target/model.onnx",
        files={},
        architecture="LlamaForCausalLM",
        model_type="llama",
        num_layers=1,
        num_kv_heads=1,
        head_dim=4,
        vocab_size=8,
        max_positions=16,
        dtype="float32",
        io=io,
    )
    (tmp_path / "model.plan").write_bytes(b"plan")
    decoder = PlanDecoder(tmp_path / "model.plan", spec, 8, "target", max_length=16)
    with pytest.raises(BundleError, match=r"no input_ids of shape \(1, 2\)") as caught:
        decoder.forward([3, 4])
    assert "specrt build --bundle DIR --tensorrt" in str(caught.value)
    assert "execute" not in calls  # nothing ran

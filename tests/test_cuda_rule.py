"""What the device engines must do for CUDA that the CPU does not ask of them: push host inputs
to the device before every run, slice the kept rows from a host input, honour the provider's
device, and manage the cache in device memory. Run on the CPU under `tests/cuda_rule.py`."""

from __future__ import annotations

import tracemalloc

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from specrt.backends import host_inputs
from specrt.backends.device_rows import DeviceOps, _zeros_graph
from specrt.backends.select import engine_device, select_graph
from specrt.bundle import read_manifest
from specrt.checksums import sha256_file
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from tests.cuda_rule import batched
from tests.test_batching import run_all, varied
from tests.test_cuda_engine import CUDA, PROMPTS, cpu_twin


@pytest.mark.usefixtures("cuda_rule")
@pytest.mark.parametrize("transfer", host_inputs.TRANSFERS)
def test_each_way_of_pushing_host_inputs_decodes_as_the_target_alone(
    cuda_bundle, monkeypatch, transfer
):
    """Device twins refreshed in place, or host values bound again: both exact, one row and
    four (the device check times the two on a GPU)."""
    monkeypatch.setattr(host_inputs, "TRANSFER", transfer)
    expected = run_all(cpu_twin(cuda_bundle), varied(0, ignore_eos=True))
    for batch in (1, 4) if batched(cuda_bundle) else (1,):
        generator = cpu_twin(cuda_bundle, max_batch=batch)
        assert generator.target._inputs._transfer == transfer
        results = run_all(generator, varied(3, ignore_eos=True))
        assert {key: r.token_ids for key, r in results.items()} == {
            key: r.token_ids for key, r in expected.items()
        }


def test_the_kept_rows_are_sliced_from_a_graph_input(cuda_bundle):
    """CUDA's Slice reads its start on the host: computed on the device (Neg of the count, as
    before), onnxruntime copies it back in every call and refuses CUDA graphs. Every engine's
    head slices from the graph input `logits_start` itself."""
    manifest = read_manifest(cuda_bundle)
    for spec in manifest.models.values():
        for engine in spec.engines.values():
            assert engine.io.logits_start == "logits_start" and not engine.io.logits_to_keep
            graph = onnx.load(str(cuda_bundle / engine.path), load_external_data=False).graph
            inputs = {value.name for value in graph.input}
            head = [node for node in graph.node if node.op_type == "Slice"][-1]
            assert head.input[1] == "logits_start" and "logits_start" in inputs


def test_provider_options_pairs_choose_the_cuda_engine_and_device():
    """onnxruntime takes (name, options) pairs: the device engine's memory then went to the
    CPU inside a CUDA session (the device was chosen by comparing the pair to a name)."""
    assert engine_device([("CUDAExecutionProvider", {"device_id": "1"}), "CPU"]) == ("cuda", 1)
    assert engine_device(["CUDAExecutionProvider"]) == ("cuda", 0)
    assert engine_device([("CPUExecutionProvider", {})]) == ("cpu", 0)


def test_a_cuda_provider_with_options_runs_the_device_backend(cuda_bundle, cuda_rule):
    spec = read_manifest(cuda_bundle).models["target"]
    pair = [("CUDAExecutionProvider", {"device_id": "0"}), "CPUExecutionProvider"]
    assert select_graph(spec, "target", "auto", pair).path == spec.engines["cuda"].path
    generator = SpeculativeGenerator.from_bundle(cuda_bundle, threads=1, providers=pair)
    assert generator.target.device == "cuda" and generator.target.device_id == 0
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    plain = SpeculativeGenerator.from_bundle(cuda_bundle, threads=1, providers=CUDA)
    assert [r.token_ids for r in generator.generate(PROMPTS, config)] == [
        r.token_ids for r in plain.generate(PROMPTS, config)
    ]


@pytest.mark.usefixtures("cuda_rule", "small_steps")
def test_the_device_cache_grows_on_the_device_and_keeps_its_blocks(batched_bundle):
    """Growing allocates and zeroes in device memory (no host array of the cache's size: that
    was a host np.zeros copied up, seconds at 64 rows); `reserve` takes the largest blocks
    once, and later growth and shrinking move rows within them, content kept."""
    decoder = cpu_twin(batched_bundle, max_batch=3).target
    alone = cpu_twin(batched_bundle).target
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 40, n).tolist() for n in (6, 14, 9)]
    decoder.prefill_rows(0, prompts)
    tracemalloc.start()
    decoder.reserve()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert decoder.capacity == 16 and decoder.cache_bytes > 20 * peak
    blocks = [buffer.data_ptr() for buffer in decoder._buffers]
    more = rng.integers(3, 40, (3, 20))
    out = decoder.forward_rows(more, keep_last=20).logits.copy()  # grows within the blocks
    assert decoder.capacity == 48 and [b.data_ptr() for b in decoder._buffers] == blocks
    for row, prompt in enumerate(prompts):
        alone.reset()
        expected = alone.forward(prompt + more[row].tolist(), keep_last=20).logits
        np.testing.assert_allclose(out[row], expected, atol=1e-3, rtol=0)
    decoder.set_length(1, 0)
    decoder.set_length(2, 0)
    decoder.shrink()  # row 0 alone: 26 positions, two steps
    assert decoder.capacity == 32 and [b.data_ptr() for b in decoder._buffers] == blocks
    last = decoder.forward_rows(more[:1, :2], keep_last=2).logits
    alone.reset()
    expected = alone.forward(prompts[0] + more[0].tolist() + more[0, :2].tolist(), keep_last=2)
    np.testing.assert_allclose(last[0], expected.logits, atol=1e-3, rtol=0)


@pytest.mark.parametrize("shift", [-7, -3, 3, 7, 30])
def test_moving_within_a_block_is_a_memmove(shift):
    """Rows move within one block when the capacity changes, their old and new places
    overlapping: no device copy may overlap itself (CUDA leaves that undefined; the CPU's copy
    happens to cope), so the copies go in chunks no longer than the distance, from the far
    end."""
    ops = DeviceOps("cpu", 0, "float32")
    copies, copy = [], ops._copy_elements
    ops._copy_elements = lambda *args: copies.append(args) or copy(*args)
    data = np.arange(64, dtype=np.float32)
    block = ort.OrtValue.ortvalue_from_numpy(data.copy())
    src, count = 12, 20
    ops.move(block, src, src + shift, count)
    for _, start, _, end, size in copies:
        assert start + size <= end or end + size <= start, (start, end, size)
    expected = data.copy()
    expected[src + shift : src + shift + count] = data[src : src + count]
    np.testing.assert_array_equal(block.numpy(), expected)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_zeros_graph_is_the_model_onnx_would_write(dtype):
    """Device memory is zeroed by a one-node model written without the onnx package: it is the
    model onnx.helper builds, passes onnx's checker, and zeroes a block full of NaN."""
    from onnx import TensorProto, checker, helper, load_from_string

    element = {"float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}[dtype]
    zero = helper.make_tensor("value", element, [1], bytes(np.dtype(dtype).itemsize), raw=True)
    graph = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["shape"], ["y"], value=zero)],
        "zeros",
        [helper.make_tensor_value_info("shape", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", element, ["n"])],
    )
    expected = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    expected.ir_version = 10
    written = load_from_string(_zeros_graph(dtype))
    checker.check_model(written, full_check=True)
    assert written == expected
    block = ort.OrtValue.ortvalue_from_numpy(np.full(37, np.nan, dtype=dtype))
    DeviceOps("cpu", 0, dtype).zero(block)
    assert not block.numpy().any()


def as_an_earlier_release(bundle, copy):
    """A copy of ``bundle`` whose engines take ``logits_to_keep`` (the count, negated in the
    graph) as engines of earlier releases did."""
    import json
    import shutil

    from onnx import helper

    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for model in manifest["models"].values():
        for engine in model["engines"].values():
            path = copy / engine["path"]
            graph = onnx.load(str(path), load_external_data=False)
            for value in graph.graph.input:
                if value.name == "logits_start":
                    value.name = "logits_to_keep"
            neg = helper.make_node("Neg", ["logits_to_keep"], ["logits_start"])
            graph.graph.node.insert(0, neg)
            onnx.save_model(graph, str(path))
            engine["io"].update(logits_to_keep="logits_to_keep", logits_start=None)
            engine["files"][engine["path"]] = sha256_file(path)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.usefixtures("cuda_rule")
def test_engines_of_an_earlier_release_still_run(cuda_bundle, tmp_path):
    """Engines built before the start became the input keep working: the count is fed where
    the graph takes ``logits_to_keep`` (the CPU engine and the device backend)."""
    earlier = as_an_earlier_release(cuda_bundle, tmp_path / "earlier")
    config = GenerationConfig(max_new_tokens=10, num_draft_tokens=3, ignore_eos=True)
    for providers in (CUDA, ["CPUExecutionProvider"]):
        now, before = (
            SpeculativeGenerator.from_bundle(bundle, threads=1, providers=providers)
            for bundle in (cuda_bundle, earlier)
        )
        assert (now.target._keep_sign, before.target._keep_sign) == (-1, 1)
        tokens = [[r.token_ids for r in g.generate(PROMPTS, config)] for g in (now, before)]
        assert tokens[0] == tokens[1], providers

"""The CUDA engines (float16, greedy outputs, many rows per call) and the device backend, tested
on the CPU under CUDA's rule for host inputs (`tests/cuda_rule.py`: a host input is copied when
it is bound; "cuda" memory is CPU memory onnxruntime allocated), and the float16 graph on
onnxruntime's CPU kernels. Where a GPU and onnxruntime-gpu are present `test_on_cuda` runs it on
CUDA."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest

from specrt.backends import NEED_ARGMAX, NEED_LOGITS, NEED_PROBABILITIES
from specrt.backends.device import DeviceDecoder
from specrt.backends.device_rows import DeviceRowsDecoder, _identity_graph
from specrt.backends.select import select_graph
from specrt.backends.session import cuda_devices, usable_providers
from specrt.bundle import read_manifest
from specrt.errors import InvalidInputError
from specrt.export.options import DEFAULT_FP16_ATOL
from specrt.export.tiny import make_tiny_pair
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from tests.cuda_rule import batched
from tests.test_batching import (
    POISONED_FROM,
    assert_row_0_failed_alone,
    poisoned_copy,
    run_all,
    run_with_a_long_row,
    varied,
)

HAS_CUDA = "CUDAExecutionProvider" in usable_providers()  # onnxruntime-gpu and a GPU
CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
PROMPTS = ["Simple is", "def f", "for i in range(", "Flat is better than", "x = "]


def test_export_records_the_cuda_engines(cuda_bundle):
    manifest = read_manifest(cuda_bundle)
    for spec in manifest.models.values():
        engine = spec.engines["cuda"]
        assert engine.provider == "CUDAExecutionProvider"
        assert engine.dtype == engine.precision == "float16"
        assert engine.io.argmax == "argmax" and engine.io.max_logit == "max_logit"
        check = engine.export_check
        assert 0 < check["max_abs_logit_diff"] <= check["atol"] == DEFAULT_FP16_ATOL, check
        graph = onnx.load(str(cuda_bundle / engine.path), load_external_data=False).graph
        types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}
        assert types["past_key_values.0.key"] == onnx.TensorProto.FLOAT16
        assert types["logits"] == types["probabilities"] == onnx.TensorProto.FLOAT
        assert "onnxruntime" in spec.engines  # the CPU engines are built as well
        attention = [node for node in graph.node if node.op_type == "Attention"]
        if "batched_lengths" in cuda_bundle.parent.name:  # by each row's length, no mask read
            assert engine.io.kv_lengths == "kv_lengths"
            assert all(node.input[6] == "kv_lengths" and node.input[3] == "" for node in attention)
        elif attention:
            assert engine.io.kv_lengths is None and attention[0].input[3] == "attention_mask"


def cpu_twin(bundle, max_batch: int = 1) -> SpeculativeGenerator:
    """The cuda engines through the device backend, as on a GPU, under CUDA's rule (the test
    uses the ``cuda_rule`` fixture)."""
    generator = SpeculativeGenerator.from_bundle(
        bundle, threads=1, providers=CUDA, max_batch=max_batch
    )
    kind = DeviceRowsDecoder if batched(bundle) else DeviceDecoder
    assert isinstance(generator.target, kind) and generator.target.device == "cuda"
    assert generator.max_batch == max_batch
    return generator


@pytest.mark.usefixtures("cuda_rule")
def test_speculative_greedy_equals_target_only_on_the_cuda_engine(cuda_bundle):
    generator = cpu_twin(cuda_bundle)
    options = dict(max_new_tokens=24, ignore_eos=True)
    baseline = [
        r.token_ids
        for r in generator.generate(PROMPTS, GenerationConfig(num_draft_tokens=0, **options))
    ]
    for k, schedule in [(1, "fixed"), (2, "fixed"), (4, "fixed"), (6, "adaptive")]:
        config = GenerationConfig(num_draft_tokens=k, draft_schedule=schedule, **options)
        results = generator.generate(PROMPTS, config)
        assert [r.token_ids for r in results] == baseline, (k, schedule)
        accepted = sum(r.stats.accepted_tokens for r in results)
        assert 0 < accepted < sum(r.stats.drafted_tokens for r in results)


@pytest.mark.usefixtures("cuda_rule")
def test_only_what_is_needed_comes_back(cuda_bundle):
    decoder = cpu_twin(cuda_bundle).target
    prompt = [3, 4, 5, 6, 7, 8]
    full = decoder.forward(prompt, need=NEED_LOGITS)
    logits = full.logits.copy()
    assert full.probabilities is None and full.argmax is None
    decoder.rollback(0)
    picks = decoder.forward(prompt, need=NEED_ARGMAX)
    assert picks.logits is None and picks.probabilities is None
    assert picks.argmax == logits.argmax(axis=-1).tolist()
    np.testing.assert_allclose(picks.max_logit, logits.max(axis=-1), rtol=0, atol=1e-6)
    top = 1 / np.exp(logits - logits.max(axis=-1, keepdims=True)).sum(axis=-1)
    np.testing.assert_allclose(picks.max_probability, top, rtol=0, atol=1e-6)
    decoder.rollback(0)
    soft = decoder.forward(prompt, need=NEED_PROBABILITIES)
    assert soft.logits is None
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(
        soft.probabilities, expected / expected.sum(-1, keepdims=True), atol=1e-6
    )


@pytest.mark.usefixtures("cuda_rule")
def test_rollback_on_the_device_cache(cuda_bundle):
    """The cache is not replaced while it has room; rolled-back positions are overwritten."""
    decoder = cpu_twin(cuda_bundle).target
    cache = decoder._buffers if batched(cuda_bundle) else decoder._cache  # OrtValues
    pointers = [value.data_ptr() for value in cache]
    assert len(set(pointers)) == len(pointers)  # one buffer per layer and kind
    rng = np.random.default_rng(0)
    prompt, rejected, kept = [rng.integers(3, 40, n).tolist() for n in (9, 5, 3)]
    decoder.forward(prompt)
    decoder.forward(rejected)
    decoder.rollback(len(prompt) + 2)
    after = decoder.forward(kept).logits.copy()
    assert [value.data_ptr() for value in cache] == pointers
    decoder.rollback(0)
    clean = decoder.forward(prompt + rejected[:2] + kept).logits[-3:]
    np.testing.assert_allclose(after, clean, atol=2e-2, rtol=0)  # float16 engine, other shapes


@pytest.mark.usefixtures("cuda_rule")
def test_rows_of_the_device_cache_move_and_grow_with_their_content(batched_bundle, small_steps):
    """Rows prefilled together, one freed and another moved into its slot (as the scheduler
    packs live rows), one copied into the free slot, then fed together past the capacity (the
    buffers reallocated on the device, the rows copied over): each row's logits are those of
    its tokens fed alone."""
    decoder = cpu_twin(batched_bundle, max_batch=3).target
    alone = cpu_twin(batched_bundle).target
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 40, n).tolist() for n in (5, 12, 9)]
    decoder.prefill_rows(0, prompts)
    decoder.set_length(0, 0)
    decoder.move_row(2, 0)
    assert decoder.lengths.tolist() == [9, 12, 0] and decoder.capacity == 16
    decoder.copy_row(1, 2)  # rows admitted with one prompt read it once
    assert decoder.lengths.tolist() == [9, 12, 12]
    more = rng.integers(3, 40, (3, 20))
    out = decoder.forward_rows(more, keep_last=20).logits
    assert decoder.capacity == 32
    for row, prompt in enumerate((prompts[2], prompts[1], prompts[1])):
        alone.reset()
        expected = alone.forward(prompt + more[row].tolist(), keep_last=20).logits
        np.testing.assert_allclose(out[row], expected, atol=1e-3, rtol=0)
    picks = decoder.forward_rows(more[:, :1], keep_last=1, need=NEED_ARGMAX)
    assert picks.logits is None and picks.argmax.shape == (3, 1)


@pytest.mark.usefixtures("cuda_rule")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_nan_logits_fails_alone_on_the_cuda_engine(
    batched_bundle, tmp_path, temperature
):
    """As on the CPU engine: one row's NaN logits (seen through the device's max logit when
    only argmaxes come back) end that row alone; the others give their tokens."""
    if read_manifest(batched_bundle).models["target"].model_type != "llama":
        pytest.skip("the poison goes into the rotary table")
    expected = run_with_a_long_row(batched_bundle, 4, temperature, providers=CUDA)
    poisoned = poisoned_copy(batched_bundle, tmp_path, POISONED_FROM, engine="cuda")
    results = run_with_a_long_row(poisoned, 4, temperature, providers=CUDA)
    assert_row_0_failed_alone(results, expected)


@pytest.mark.usefixtures("cuda_rule")
def test_clear_stale_zeroes_the_device_cache_past_each_row(batched_bundle):
    """After NaN logits the slots past every row's length are zeroed (masked slots still enter
    attention with weight 0, and 0 x NaN is NaN); the rows' own positions are kept."""
    decoder = cpu_twin(batched_bundle, max_batch=3).target
    rng = np.random.default_rng(4)
    decoder.prefill_rows(0, [rng.integers(3, 40, n).tolist() for n in (7, 11, 4)])
    before = [buffer.numpy().copy() for buffer in decoder._buffers]
    decoder.set_length(1, 5)
    decoder.clear_stale()
    for old, buffer in zip(before, decoder._buffers):
        new = buffer.numpy()
        for row, length in enumerate((7, 5, 4)):
            np.testing.assert_array_equal(new[row, :length], old[row, :length])
            assert not new[row, length:].any()
        assert old[1, 5:11].any()  # there was something to clear


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_copy_graph_is_the_model_onnx_would_write(dtype):
    """The device copy's one-node model is written without the onnx package (the runtime does
    not depend on it): it is the model onnx.helper builds, and passes onnx's checker."""
    from onnx import TensorProto, checker, helper, load_from_string

    element = {"float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}[dtype]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "copy",
        [helper.make_tensor_value_info("x", element, ["n"])],
        [helper.make_tensor_value_info("y", element, ["n"])],
    )
    expected = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    expected.ir_version = 10
    written = load_from_string(_identity_graph(dtype))
    checker.check_model(written, full_check=True)
    assert written == expected


@pytest.mark.usefixtures("cuda_rule")
def test_batched_greedy_on_the_cuda_engine_equals_target_alone(batched_bundle, small_steps):
    """B rows per call on the device backend (rows of different lengths finishing at
    different rounds, refilled, moved, the cache growing): every row is the target alone's."""
    expected = run_all(cpu_twin(batched_bundle), varied(0, ignore_eos=True))
    for batch in (2, 4, 8):
        generator = cpu_twin(batched_bundle, max_batch=batch)
        grown, grow = [], generator.target._grow
        generator.target._grow = lambda needed, grown=grown, grow=grow: (
            grown.append(needed) or grow(needed)
        )
        for k, schedule in ((0, "fixed"), (3, "fixed"), (4, "adaptive")):
            results = run_all(generator, varied(k, schedule, ignore_eos=True))
            for key, result in results.items():
                assert result.token_ids == expected[key].token_ids, (batch, k, key)
            if k:
                accepted = sum(r.stats.accepted_tokens for r in results.values())
                drafted = sum(r.stats.drafted_tokens for r in results.values())
                assert 0 < accepted <= drafted
                if schedule == "fixed":  # rejections rolled back too (the load schedule may
                    assert accepted < drafted  # settle on K = 0 after measuring K = 1)
        assert max(grown) > 16  # it grew (and shrank back once the batch was empty)


@pytest.mark.usefixtures("cuda_rule")
def test_a_seeded_row_is_the_same_whatever_the_batch_on_the_cuda_engine(batched_bundle):
    config = GenerationConfig(max_new_tokens=20, temperature=1.0, num_draft_tokens=3, seed=11)
    outputs = [
        [r.token_ids for r in cpu_twin(batched_bundle, batch).generate(PROMPTS, config)]
        for batch in (1, 3)
    ]
    assert outputs[0] == outputs[1]
    assert len({tuple(tokens) for tokens in outputs[0]}) > 1


@pytest.mark.usefixtures("cuda_rule")
def test_the_cuda_engine_is_close_to_the_float32_graph(cuda_bundle):
    ids = np.random.default_rng(1).integers(3, 40, 12).tolist()
    half = cpu_twin(cuda_bundle).target.forward(ids).logits.copy()
    full = SpeculativeGenerator.from_bundle(
        cuda_bundle, threads=1, engine="portable", providers=["CPUExecutionProvider"]
    )
    reference = full.target.forward(ids).logits
    assert np.abs(half - reference).max() < DEFAULT_FP16_ATOL


def test_backend_choice_follows_the_providers(cuda_bundle, caplog):
    spec = read_manifest(cuda_bundle).models["target"]
    cpu = ["CPUExecutionProvider"]
    assert select_graph(spec, "target", "auto", cpu).path == spec.engines["onnxruntime"].path
    assert select_graph(spec, "target", "auto", CUDA).path == spec.engines["cuda"].path
    assert select_graph(spec, "target", "cuda", cpu).path == spec.engines["cuda"].path
    with pytest.raises(Exception, match="use engine 'cuda', 'portable' or 'auto' on GPU"):
        select_graph(spec, "target", "onnxruntime", CUDA)
    bare = spec.engine_view("onnxruntime")  # a model without engines
    with caplog.at_level(logging.WARNING, logger="specrt"):
        assert select_graph(bare, "target", "auto", CUDA, "b/x") is bare
    assert "no cuda engine" in caplog.text and "--bundle b/x --device cuda" in caplog.text
    with pytest.raises(Exception, match="--device cuda"):
        select_graph(bare, "target", "cuda", cpu)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specrt"):  # said, not silently slow
        select_graph(spec, "target", "cuda", cpu)
    assert "the cuda engine runs on the CPU here" in caplog.text


def test_a_gpu_provider_that_does_not_start_is_named_where_it_is_opened(cuda_bundle):
    """onnxruntime opens a session asking for CUDA on the CPU when the provider's libraries do
    not load (here: a CPU build that lacks it); the cuda engine then crashed far away, binding
    device memory on a CPU session. The decoder's opening says what happened instead."""
    if cuda_devices():
        pytest.skip("a GPU is visible: CUDA starts here")
    from specrt.backends.select import open_decoder

    manifest = read_manifest(cuda_bundle)
    spec = manifest.models["target"]
    with pytest.raises(InvalidInputError, match="could not start CUDAExecutionProvider"):
        open_decoder(cuda_bundle, spec, "target", manifest.vocab_size, "cuda", CUDA, threads=1)


def test_gpu_providers_count_only_where_a_gpu_is_visible():
    """onnxruntime-gpu lists CUDA on any machine; on one without a GPU a session asking for it
    fell back to the CPU (a red error, and the portable graph instead of the CPU engine), and a
    bundle with cuda engines ended in a traceback. The driver's own count decides."""
    listed = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    usable = usable_providers(listed)
    if cuda_devices():
        assert usable == listed
    else:
        assert usable == ["CPUExecutionProvider"]


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA provider here (onnxruntime-gpu and a GPU)")
def test_on_cuda(cuda_bundle):
    generator = SpeculativeGenerator.from_bundle(cuda_bundle, providers=CUDA)
    assert generator.target.device == "cuda"
    options = dict(max_new_tokens=24, ignore_eos=True)
    baseline = [
        r.token_ids
        for r in generator.generate(PROMPTS, GenerationConfig(num_draft_tokens=0, **options))
    ]
    spec = generator.generate(PROMPTS, GenerationConfig(num_draft_tokens=4, **options))
    assert [r.token_ids for r in spec] == baseline


def test_engines_only_bundle_needs_no_optimum(tmp_path, monkeypatch, caplog):
    """--no-portable: no optimum import (it is made to fail here), the model's graph is its
    cuda engine, and the bundle runs through the device backend."""
    import builtins

    from specrt.export import export_bundle

    real_import = builtins.__import__

    def no_optimum(name, *args, **kwargs):
        if name.startswith("optimum"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    target, draft = make_tiny_pair("llama", tmp_path / "src", seed=3, draft_noise=0.3)
    monkeypatch.setattr(builtins, "__import__", no_optimum)
    export_bundle(target, draft, tmp_path / "b", portable=False, devices=("cuda",))
    monkeypatch.undo()
    manifest = read_manifest(tmp_path / "b")
    for spec in manifest.models.values():
        assert spec.path == spec.engines["cuda"].path and spec.dtype == "float16"
        assert list(spec.engines) == ["cuda"]
    with caplog.at_level(logging.WARNING, logger="specrt"):
        generator = SpeculativeGenerator.from_bundle(tmp_path / "b", threads=1)
    assert isinstance(generator.target, DeviceRowsDecoder)
    assert "no onnxruntime engine for the CPU, so its cuda engine (float16" in caplog.text
    with pytest.raises(InvalidInputError, match="has no portable graph .*--no-portable"):
        SpeculativeGenerator.from_bundle(tmp_path / "b", threads=1, engine="portable")
    options = dict(max_new_tokens=16, ignore_eos=True)
    base = generator.generate(PROMPTS, GenerationConfig(num_draft_tokens=0, **options))
    spec = generator.generate(PROMPTS, GenerationConfig(num_draft_tokens=3, **options))
    assert [r.token_ids for r in spec] == [r.token_ids for r in base]


@pytest.mark.parametrize("vocab", [300, 512, 4099])
def test_chunked_greedy_outputs_are_the_direct_ones(vocab):
    """The two-stage greedy outputs (`cuda_reductions="chunked"`) give the one-stage numbers:
    numpy's argmax (the first of equal maxima: every row holds planted ties, one across a chunk
    boundary), the max logit and the max probability, bit for bit; a vocabulary that does not
    fill its last chunk included."""
    from specrt.export.ort_builder import REDUCTION_CHUNK

    logits = np.random.default_rng(0).standard_normal((3, 4, vocab)).astype(np.float32)
    top = logits.max(axis=-1) + 1
    logits[0, :, [REDUCTION_CHUNK - 1, REDUCTION_CHUNK]] = top[0]  # a tie across two chunks
    logits[1, :, [7, vocab - 1]] = top[1]  # the last column, in the last (partial) chunk
    logits[2, :, vocab - 1] = top[2]  # a maximum alone in the last column
    argmax, max_logit, max_probability = _greedy_session(vocab, "chunked").run(
        None, {"logits": logits}
    )
    assert argmax.tolist() == logits.argmax(axis=-1).tolist()
    assert argmax[0].tolist() == [REDUCTION_CHUNK - 1] * 4 and argmax[1].tolist() == [7] * 4
    assert argmax[2].tolist() == [vocab - 1] * 4
    direct = _greedy_session(vocab, "direct").run(None, {"logits": logits})
    for chunked, one_stage in zip((argmax, max_logit, max_probability), direct):
        np.testing.assert_array_equal(chunked, one_stage)


def _greedy_session(vocab: int, reductions: str):
    """The greedy outputs as the cuda engines compute them from ``logits [B, n, vocab]``."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from specrt.export.ort_builder import (
        ARGMAX,
        MAX_LOGIT,
        MAX_PROBABILITY,
        PROBABILITIES,
        _GraphBuilder,
        _greedy_outputs,
    )

    b = _GraphBuilder({})
    b.node("Softmax", ["logits"], [PROBABILITIES], axis=-1)
    _greedy_outputs(b, vocab, reductions)
    shape = ["batch", "kept"]
    outputs = [helper.make_tensor_value_info(ARGMAX, TensorProto.INT64, shape)]
    outputs += [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
        for name in (MAX_LOGIT, MAX_PROBABILITY)
    ]
    inputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [*shape, vocab])]
    graph = helper.make_graph(b.nodes, "greedy", inputs, outputs, initializer=b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.usefixtures("cuda_rule", "small_steps")
def test_chunked_greedy_outputs_decode_as_the_direct_ones(tmp_path):
    """A cuda engine exported with the chunked greedy outputs picks the tokens the direct one
    picks, the target alone and speculative, one row and batched."""
    from specrt.export import export_bundle

    target, draft = make_tiny_pair("llama", tmp_path / "src", seed=3, draft_noise=0.3)
    options = dict(max_new_tokens=20, ignore_eos=True)
    tokens = {}
    for reductions in ("direct", "chunked"):
        bundle = tmp_path / reductions
        export_bundle(
            target, draft, bundle, devices=("cuda",), portable=False, cuda_reductions=reductions
        )
        for batch in (1, 3):
            generator = cpu_twin(bundle, max_batch=batch)
            for k in (0, 3):
                config = GenerationConfig(num_draft_tokens=k, **options)
                results = generator.generate(PROMPTS, config)
                tokens[reductions, batch, k] = [r.token_ids for r in results]
    assert len({str(picked) for picked in tokens.values()}) == 1


def test_the_cli_chooses_how_the_greedy_outputs_reduce(tmp_path):
    """`--cuda-reductions` reaches the cuda engines: two stages by default (a GatherElements
    picks each row's chunk), one ArgMax a row with `direct`."""
    from click.testing import CliRunner

    from specrt.cli import main

    target, draft = make_tiny_pair("llama", tmp_path / "src", seed=3, draft_noise=0.3)
    ops = {}
    for reductions in (None, "direct"):
        out = tmp_path / str(reductions)
        args = ["export", "--target", str(target), "--draft", str(draft), "--out", str(out)]
        args += ["--device", "cuda", "--no-portable"]
        args += ["--cuda-reductions", reductions] if reductions else []
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        path = out / read_manifest(out).models["target"].engines["cuda"].path
        graph = onnx.load(str(path), load_external_data=False).graph
        ops[reductions] = [node.op_type for node in graph.node]
    assert ops[None].count("ArgMax") == 2 and "GatherElements" in ops[None]
    assert ops["direct"].count("ArgMax") == 1 and "GatherElements" not in ops["direct"]

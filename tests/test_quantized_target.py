"""A quantised target (`--target-precision int8|int4`) is a model of its own: the speculative
output must be exactly that engine's output alone, greedy and sampled, token for token.

That holds only if a verification call of several positions computes each position's logits
bit for bit as decoding it alone does: the export measures it, and these tests check both the
number and the outputs it promises."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from specrt.bundle import read_manifest
from specrt.cli import main
from specrt.errors import BundleError
from specrt.export import ENGINE_MODEL_TYPES, export_bundle
from specrt.export.options import DEFAULT_TARGET_BLOCK_SIZE, TARGET_BLOCK_SIZES
from specrt.export.quantize import not_invariant, quantize_weights
from specrt.export.tiny import make_tiny_pair
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.loading import rows_difference
from tests.conftest import build_bundle
from tests.test_greedy import PROMPTS

CONTENDERS = {
    "default": {},
    "draft model, K=4": dict(proposer="model", draft_schedule="fixed", num_draft_tokens=4),
    "draft model, K=1": dict(proposer="model", draft_schedule="fixed", num_draft_tokens=1),
    "prompt lookup": dict(proposer="lookup", draft_schedule="fixed"),
}


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized(request, tmp_path_factory):
    """A tiny Llama pair exported through the CLI with a quantised target."""
    root = tmp_path_factory.mktemp(f"target-{request.param}")
    target, draft = make_tiny_pair("llama", root / "src", seed=3, draft_noise=0.3)
    bundle = root / "bundle"
    args = ["export", "--target", str(target), "--draft", str(draft), "--out", str(bundle)]
    result = CliRunner().invoke(main, [*args, "--target-precision", request.param])
    assert result.exit_code == 0, result.output
    assert f"onnxruntime engine ({request.param})" in result.output
    return request.param, bundle


def test_the_export_records_the_precision_and_one_call_equal_to_many(quantized):
    precision, bundle = quantized
    target = read_manifest(bundle).models["target"]
    engine = target.engines["onnxruntime"]
    assert engine.precision == precision
    # several positions in one call, bit for bit what one call per position gives
    assert engine.export_check["step_vs_one_at_a_time_max_abs_diff"] == 0.0
    # and it is another model than the float32 checkpoint: the check says by how much
    assert engine.export_check["max_abs_logit_diff"] > 1e-3


@pytest.mark.parametrize("batch", [False, True])
def test_greedy_output_equals_the_quantized_target_alone(quantized, batch):
    _, bundle = quantized
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1, max_batch=4 if batch else 1)
    prompts = PROMPTS[:12]

    def run(**options):
        config = GenerationConfig(max_new_tokens=40, ignore_eos=True, **options)
        if batch:
            return [r.token_ids for r in generator.generate(prompts, config)]
        return [generator.generate([p], config)[0].token_ids for p in prompts]

    alone = run(num_draft_tokens=0)
    for name, options in CONTENDERS.items():
        generator.forget_learning()  # learners start fresh: they draft while they learn
        assert run(**options) == alone, name


def test_seeded_sampling_equals_the_quantized_target_alone(quantized):
    """Under a seed a row's draws are keyed by position, so its sampled tokens are those the
    target alone samples: a difference in any verified position's logits would show here."""
    _, bundle = quantized
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    sampled = dict(max_new_tokens=40, ignore_eos=True, temperature=1.0, top_k=50, seed=11)
    alone = generator.generate(PROMPTS[:8], GenerationConfig(num_draft_tokens=0, **sampled))
    for name, options in CONTENDERS.items():
        generator.forget_learning()
        config = GenerationConfig(**{**sampled, **options})
        results = generator.generate(PROMPTS[:8], config)
        assert [r.token_ids for r in results] == [r.token_ids for r in alone], name
        if name == "draft model, K=4":  # drafts were verified, some kept, some not
            accepted = sum(r.stats.accepted_tokens for r in results)
            assert 0 < accepted < sum(r.stats.drafted_tokens for r in results)


@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("arch", [a for a in ENGINE_MODEL_TYPES if a != "llama"])
def test_every_family_int4_target_is_verified_exactly(tmp_path, arch, block):
    """The even rows (blocks of 32 and 128) under each family's own options: soft-capping,
    sliding windows (two masks for Gemma 2), q/k norms, GPT-2's positions."""
    window = 6 if arch in ("mistral", "qwen2", "gemma2") else None
    options = {"target_precision": "int4", "portable": False, "target_block_size": block}
    bundle = build_bundle(tmp_path, arch, options, arch=arch, sliding_window=window)
    engine = read_manifest(bundle).models["target"].engines["onnxruntime"]
    assert engine.block_size == block and engine.even_rows
    written = json.loads((bundle / "manifest.json").read_text())["models"]
    assert "even_rows" not in written["target"]  # its engines say, where it is true
    assert written["target"]["engines"]["onnxruntime"]["even_rows"]
    assert "even_rows" not in written["draft"]["engines"]["onnxruntime"]
    assert "block_size" not in written["draft"]["engines"].get("portable", {})
    assert engine.export_check["step_vs_one_at_a_time_max_abs_diff"] == 0.0
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    # The copy runs where a row alone would round otherwise on this CPU (on AVX2 in blocks of
    # 32, not with AVX-512 VNNI: `check_exact_rows`), and the schedule is told which.
    target, paired = generator.target, generator.target.spec.even_rows
    target.pair_rows(False)
    assert paired == (rows_difference(target) > 0)
    target.pair_rows(paired)

    def run(**options):
        config = GenerationConfig(max_new_tokens=24, ignore_eos=True, **options)
        return [r.token_ids for r in generator.generate(PROMPTS[:6], config)]

    alone = run(num_draft_tokens=0)
    assert run(**CONTENDERS["draft model, K=4"]) == alone  # calls of 5 positions
    assert run(**CONTENDERS["draft model, K=1"]) == alone  # and of 2


def _quantized_matmul(tmp_path: Path, weight: np.ndarray, precision: str, block: int):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", weight.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "w")],
    )
    path = tmp_path / f"mm{block}.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    quantize_weights(path, precision, block, symmetric=block != DEFAULT_TARGET_BLOCK_SIZE)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_each_target_block_size_gives_a_row_of_an_even_count_the_same_bits_whatever_its_partners(
    tmp_path, precision
):
    """Why a quantised target's graph feeds its matrix products an even number of rows
    (`_even_rows`): onnxruntime's int8-compute kernels multiply a row alone with a kernel of
    their own (on AVX2 a call of one row, with AVX-512 and blocks of 64 or more the last of an
    odd count), which rounds otherwise. Every row of an even count equals that row beside a
    copy of itself, whichever rows it is called with, for every block size."""
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((576, 512)) * 0.05).astype(np.float32)
    rows = rng.standard_normal((9, 576)).astype(np.float32)
    for block in TARGET_BLOCK_SIZES:
        session = _quantized_matmul(tmp_path, weight, precision, block)

        def run(x: np.ndarray, session=session) -> np.ndarray:
            return session.run(None, {"x": x})[0]

        alone = np.concatenate([run(rows[i : i + 1]) for i in range(9)])
        paired = np.concatenate([run(rows[[i, i]])[:1] for i in range(9)])
        if precision == "int4" and block >= 64:  # a row alone: other bits, on every CPU
            assert not np.array_equal(alone, paired), block
        for start, count in ((0, 8), (1, 2), (1, 6), (3, 4)):  # other partners, other counts
            together = run(rows[start : start + count])
            assert np.array_equal(together, paired[start : start + count]), (block, count)


@pytest.mark.parametrize("block", [32, 128])
def test_the_demo_pair_with_an_int4_target_gives_that_target_s_own_output(tmp_path, block):
    """On the trained demo pair a verification whose logits differ from decoding alone by
    rounding (the Attention op's kernels, blocks of 128) changed 2-3 rows of these 24: the
    check the tiny random pairs above are too peaked to make."""
    demo = Path(__file__).resolve().parents[1] / "models" / "demo"
    bundle = tmp_path / "demo-int4"
    export_bundle(
        demo / "target", demo / "draft", bundle, target_precision="int4", portable=False,
        target_block_size=block,
    )  # fmt: skip
    lines = (demo / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines[:24]]
    generator = SpeculativeGenerator.from_bundle(bundle, max_batch=8)

    def run(**options):
        config = GenerationConfig(max_new_tokens=96, ignore_eos=True, **options)
        return [r.token_ids for r in generator.generate(prompts, config)]

    alone = run(num_draft_tokens=0)
    for name in ("default", "draft model, K=4"):
        assert run(**CONTENDERS[name]) == alone, name
    # the rounds of rows sharing calls are priced as the calls compute them
    assert generator.runner().schedules["load"].even_rows == generator.target.spec.even_rows


@pytest.mark.parametrize("portable", [True, False])
def test_specrt_build_quantizes_the_target_of_an_existing_bundle(tmp_path, portable):
    """Back and forth; without a portable graph the model's graph is the engine rebuilt (its
    check, bounded or not, follows it)."""
    bundle = build_bundle(tmp_path, "llama", {"portable": portable}, arch="llama")
    for precision, block in (("int8", "32"), ("int4", "128"), ("float32", "32")):
        args = ["build", "--bundle", str(bundle), "--target-precision", precision]
        result = CliRunner().invoke(main, [*args, "--target-block-size", block])
        assert result.exit_code == 0, result.output
        engine = read_manifest(bundle).models["target"].engines["onnxruntime"]
        assert engine.precision == precision
        assert engine.block_size == (None if precision == "float32" else int(block))
        if precision != "float32":
            assert engine.export_check["step_vs_one_at_a_time_max_abs_diff"] == 0.0
        if precision == "int4":  # a rebuild that names no precision keeps what it has
            result = CliRunner().invoke(main, ["build", "--bundle", str(bundle)])
            assert result.exit_code == 0, result.output
            models = read_manifest(bundle).models
            kept = models["target"].engines["onnxruntime"]
            assert (kept.precision, kept.block_size) == ("int4", 128)
            assert models["draft"].engines["onnxruntime"].precision == "int8"
    result = CliRunner().invoke(main, [*args, "--target-block-size", "48"])
    assert result.exit_code != 0 and "'48' is not one of '32', '64', '128'" in result.output
    # a block size for the float32 target it has would change nothing: named, not ignored
    result = CliRunner().invoke(
        main, ["build", "--bundle", str(bundle), "--target-block-size", "64"]
    )
    assert result.exit_code == 2 and "--target-block-size 64 is for a quantised" in result.output
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    settings = dict(max_new_tokens=16, ignore_eos=True)
    config = GenerationConfig(**settings)
    alone = generator.generate(PROMPTS[:4], GenerationConfig(**settings, num_draft_tokens=0))
    assert [r.token_ids for r in generator.generate(PROMPTS[:4], config)] == [
        r.token_ids for r in alone
    ]


def test_a_target_that_verifies_otherwise_than_it_decodes_here_is_refused_at_load(
    quantized, tmp_path
):
    """The export measured its own CPU; the runtime measures the one it runs on. A real graph
    whose logits move with the number of positions in the call (as a kernel of its own for a
    row alone makes them move on some CPUs) is refused in one line naming the fix; the
    bundle as exported loads."""
    precision, bundle = quantized
    SpeculativeGenerator.from_bundle(bundle, threads=1)
    broken = tmp_path / "broken"
    shutil.copytree(bundle, broken)
    graph_path = broken / "target" / "onnxruntime" / "model.onnx"
    model = onnx.load(str(graph_path), load_external_data=False)
    graph = model.graph
    for node in graph.node:  # logits + 1e-3 x (positions fed - 1)
        node.output[:] = ["logits.true" if name == "logits" else name for name in node.output]
        node.input[:] = ["logits.true" if name == "logits" else name for name in node.input]
    graph.initializer.extend(
        [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("one", 1), ("i1", [1]))]
    )
    graph.node.extend(
        [
            helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
            helper.make_node("Gather", ["ids_shape", "i1"], ["fed"]),
            helper.make_node("Sub", ["fed", "one"], ["fed_more"]),
            helper.make_node("Cast", ["fed_more"], ["fed_float"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["fed_float", "scale"], ["shift"]),
            helper.make_node("Add", ["logits.true", "shift"], ["logits"]),
        ]
    )
    graph.initializer.append(numpy_helper.from_array(np.array([1e-3], np.float32), "scale"))
    onnx.save_model(model, str(graph_path))  # its weights stay in the bundle's data file
    with pytest.raises(BundleError) as failure:
        SpeculativeGenerator.from_bundle(broken, threads=1, check_files=False)
    message = str(failure.value)
    assert "otherwise than the same position decoded alone on this CPU" in message
    assert f"specrt build --bundle {broken} --target-precision int4" in message


def test_a_cpu_where_verification_is_not_decoding_alone_is_told_so():
    check = {"step_vs_one_at_a_time_max_abs_diff": 0.02}
    warning = not_invariant(check, "int4")
    assert "differ from decoding them one at a time by 2.00e-02" in warning
    assert "--target-precision float32" in warning
    assert not_invariant(check, "float32") is None  # a float32 target's rounding: see exactness
    assert not_invariant({"step_vs_one_at_a_time_max_abs_diff": 0.0}, "int4") is None


def test_one_query_row_more_gives_each_position_the_bits_of_its_own_call():
    """Why a quantised target's call of one position (or any odd count) computes a copy of its
    last along (`_even_rows`), for its attention too: the Attention op rounds a call of one
    position differently from a call of several (MLAS's one-row kernel), and a row more keeps
    every call on the kernel for several; a float32 target's attention likewise computes at
    least two query rows (`_two_query_rows_attention`). Layout and heads as SmolLM2's (9
    query heads over 3)."""
    from onnx import TensorProto as T

    inputs = [helper.make_tensor_value_info(n, T.FLOAT, None) for n in ("q", "k", "v")]
    graph = helper.make_graph(
        [helper.make_node("Attention", ["q", "k", "v", "m"], ["y"], q_num_heads=9,
                          kv_num_heads=3, scale=0.125)],
        "g", [*inputs, helper.make_tensor_value_info("m", T.BOOL, None)],
        [helper.make_tensor_value_info("y", T.FLOAT, None)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    length, count = 200, 5
    k, v = (rng.standard_normal((1, length, 192)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, count, 576)).astype(np.float32)
    mask = np.arange(length)[None, None, None, :] <= np.arange(count)[None, None, :, None] + 190

    def attend(rows: slice, padded: bool) -> np.ndarray:
        query, seen = q[:, rows], mask[:, :, rows]
        if padded:
            query = np.concatenate([query, query[:, -1:]], axis=1)
            seen = np.concatenate([seen, seen[:, :, -1:]], axis=2)
        out = session.run(None, {"q": query, "k": k, "v": v, "m": seen})[0]
        return out[:, : out.shape[1] - padded]

    for padded in (False, True):
        together = attend(slice(None), padded)
        alone = np.concatenate([attend(slice(j, j + 1), padded) for j in range(count)], axis=1)
        difference = float(np.abs(together - alone).max())
        assert difference == 0.0 if padded else difference > 0.0


def test_a_target_with_even_rows_computes_an_eagle_head_s_features_exactly(tmp_path):
    """The features a head reads come out for the positions fed only (the copy a call of an
    odd count adds is left out), and the head's drafts, verified by that target, give its own
    output alone."""
    from specrt.backends.select import make_decoder
    from specrt.backends.session import create_session
    from specrt.export.tiny import make_tiny_head

    target, _ = make_tiny_pair("llama", tmp_path / "src", seed=5, config=dict(num_hidden_layers=4))
    head = make_tiny_head(target, tmp_path / "head", seed=1, layers=(0, 2, 3))
    bundle = tmp_path / "bundle"
    manifest = export_bundle(
        target, head, bundle, target_precision="int4", target_block_size=128, portable=False
    )
    engine = manifest.models["target"].engines["onnxruntime"]
    assert engine.block_size == 128 and engine.io.features
    assert engine.export_check["step_vs_one_at_a_time_max_abs_diff"] == 0.0
    spec = manifest.models["target"].engine_view("onnxruntime")
    session = create_session(bundle / spec.path, threads=1)
    decoder = make_decoder(session, spec, manifest.vocab_size, "target", 64)
    decoder.forward([1, 5, 7, 9, 11])
    together = decoder.features[0, 2:5].copy()  # 3 positions in one call
    decoder.rollback(2)
    for token in (7, 9, 11):
        decoder.forward([token])
    assert np.array_equal(decoder.features[0, 2:5], together)
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    settings = dict(max_new_tokens=24, ignore_eos=True, proposer="model", draft_schedule="fixed")
    alone, drafted = (
        [
            r.token_ids
            for r in generator.generate(
                PROMPTS[:3], GenerationConfig(**settings, num_draft_tokens=k)
            )
        ]
        for k in (0, 3)
    )
    assert drafted == alone


@pytest.mark.parametrize(("precision", "block"), [("int4", 32), ("int8", 128)])
def test_loading_pairs_rows_only_where_this_cpu_needs_it(tmp_path, precision, block):
    """The graph makes every count even only where its `pair_rows` input says so, and loading
    says so exactly where this CPU gives a row alone other bits than a row among others
    (measured here anew, the copy switched off): either way verifying is decoding alone, bit
    for bit. Which way depends on the CPU (on AVX2 int4 needs the pair; 8-bit weights in
    blocks of 128 gave every row the same bits), so the test holds the choice to the
    measurement, not to a CPU."""
    from specrt.runtime.loading import rows_difference

    bundle = build_bundle(
        tmp_path, "pair", {"target_precision": precision, "target_block_size": block},
        arch="llama", seed=3, draft_noise=0.3,
    )  # fmt: skip
    target = SpeculativeGenerator.from_bundle(bundle, threads=1).target
    paired = target.spec.even_rows
    target.pair_rows(False)
    needs_pair = rows_difference(target) != 0.0
    target.pair_rows(True)
    assert rows_difference(target) == 0.0
    assert paired == needs_pair


def test_a_call_of_one_position_computes_one_row_unless_paired(tmp_path):
    """onnxruntime's own profile of the int4 target's matrix products: a prompt of 3 positions
    then a step of one multiply 3 rows and 1 with `pair_rows` 0, 4 and 2 with 1 (the copy of
    an odd call's last), the logits of the rows fed either way. Its attention takes two query
    rows or more either way (the Attention op's kernel for one query row rounds otherwise), so
    weights whose kernels give a row alone its bits need no pair."""
    from specrt.backends.select import make_decoder

    bundle = build_bundle(
        tmp_path, "pair", {"target_precision": "int4"}, arch="llama", seed=3, draft_noise=0.3
    )
    spec = read_manifest(bundle).models["target"]
    view = spec.engine_view("onnxruntime")
    rows, queries = {}, {}
    for on in (False, True):
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(tmp_path / f"profile-{on}")
        session = ort.InferenceSession(
            str(bundle / view.path), options, providers=["CPUExecutionProvider"]
        )
        decoder = make_decoder(session, view, spec.vocab_size, "target")
        decoder.pair_rows(on)
        decoder.prefill([5, 6, 7])
        logits = decoder.forward([8]).logits
        events = json.loads(Path(session.end_profiling()).read_text())
        for seen, op in ((rows, "MatMulNBits"), (queries, "Attention")):
            seen[on] = {
                int(np.prod(next(iter(e["args"]["input_type_shape"][0].values()))[:-1]))
                for e in events
                if e.get("cat") == "Node" and e["args"].get("op_name") == op
            }
        assert logits.shape == (1, spec.vocab_size)
    assert rows == {False: {3, 1}, True: {4, 2}}
    assert queries == {False: {3, 2}, True: {4, 2}}


@pytest.mark.parametrize(("precision", "block"), [("int4", 32), ("int4", 128), ("int8", 32)])
def test_distill_reads_back_the_very_weights_a_quantized_target_engine_holds(
    tmp_path, precision, block
):
    """`specrt distill --target-precision` trains a head on the target as its engine computes
    it: `engine_weights` gives the weights MatMulNBits multiplies by (its float32 compute, to
    rounding), not the float32 ones, whose product is visibly another."""
    from specrt.distill.quantized import engine_weights

    rng = np.random.default_rng(1)
    weight = (rng.standard_normal((96, 80)) * 0.05).astype(np.float32)  # [out, in]: in % 32 != 0
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", 80])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight.T.copy(), "w")],
    )
    path = tmp_path / "mm.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    quantize_weights(path, precision, block, symmetric=False, accuracy_level=0)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((5, 80)).astype(np.float32)
    [engine] = session.run(None, {"x": x})
    bits = {"int4": 4, "int8": 8}[precision]
    assert np.abs(x @ engine_weights(weight, bits, block).T - engine).max() < 1e-5
    assert np.abs(x @ weight.T - engine).max() > 1e-3


def test_a_head_for_a_quantized_target_reads_what_its_engine_computes(quantized):
    """The target `specrt distill --target-precision` trains on (`quantize_like_engine`) gives
    the logits of the bundle's quantised engine, up to its 8-bit activations: far closer than
    the float32 checkpoint's, which the engine's answers part from."""
    import torch
    from transformers import AutoConfig

    from specrt.backends import NEED_LOGITS
    from specrt.distill.quantized import quantize_like_engine
    from specrt.export.checkpoints import load_causal_lm
    from specrt.runtime.loading import load_pair

    precision, bundle = quantized
    if precision != "int4":
        pytest.skip("8-bit weights are nearer float32 than the engine's 8-bit activations are")
    source = Path(read_manifest(bundle).models["target"].source)
    model = load_causal_lm(source, AutoConfig.from_pretrained(source))
    tokens = list(range(5, 45))
    pair = load_pair(bundle, threads=1)
    engine = pair.target.forward(tokens, need=NEED_LOGITS).logits
    with torch.no_grad():
        plain = model(input_ids=torch.tensor([tokens])).logits[0].numpy()
        quantize_like_engine(model, precision, DEFAULT_TARGET_BLOCK_SIZE)
        like = model(input_ids=torch.tensor([tokens])).logits[0].numpy()
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert np.abs(like - engine).max() < 0.25 * np.abs(plain - engine).max()

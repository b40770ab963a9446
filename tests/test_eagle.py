"""EAGLE-3 heads: imported in their authors' layout, checked against PyTorch at export, drafting
from the target's features in the one-row and batched rounds, and exactly lossless.

The heads are random (no download), in the exact layout published heads have
(`specrt.export.tiny.make_tiny_head`). A random head drafts badly, so the drafting itself is
checked against a PyTorch reference of the head round after round (`test_the_head_drafts_...`),
and the output's exactness the way every drafter's is: greedy and seeded output equal to the
target alone's, and sampled tokens following the target's law (chi-square, false-alarm rate
ALPHA per test, 3 tests: at most 3e-4 for the module; seeds fixed, so an outcome is
reproducible)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from specrt.backends.tensorrt import ep_options
from specrt.bundle import read_manifest
from specrt.cli import main
from specrt.errors import ExportError
from specrt.export import export_bundle
from specrt.export.eagle import Eagle3Head, read_head, target_features
from specrt.export.eagle_export import _on_target_vocab
from specrt.export.ort_eagle import vocab_map
from specrt.export.tiny import make_tiny_head, make_tiny_pair
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.batching import BatchRunner, Request
from specrt.runtime.config import SamplingParams
from specrt.runtime.round import RowRound, catch_up, draft_rows
from specrt.runtime.sampling import warp
from tests.stats import chi_square_pvalue
from tests.test_batching import counted
from tests.test_greedy import PROMPTS
from tests.test_tensorrt import parse

ALPHA = 1e-4
DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
SAMPLES = 4000
HEAD_VOCAB = 40  # of the tiny tokenizer's ~60: the head never proposes the others
MODEL_DRAFTS = dict(proposer="model", draft_schedule="fixed")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target, _ = make_tiny_pair("llama", root / "src", seed=5, peak=6.0, config=LAYERS)
    head = make_tiny_head(target, root / "head", seed=1, head_vocab=HEAD_VOCAB, layers=(0, 2, 3),
                          peak=2.0)  # fmt: skip
    return root, target, head


LAYERS = dict(num_hidden_layers=4)


@pytest.fixture(scope="module")
def bundle(sources):
    root, target, head = sources
    out = root / "bundle"
    args = ["export", "--target", str(target), "--eagle", str(head), "--out", str(out)]
    # float32: its drafts are compared with the PyTorch head's, token for token
    result = CliRunner().invoke(main, [*args, "--draft-precision", "float32"])
    assert result.exit_code == 0, result.output
    assert "draft: LlamaForCausalLMEagle3, 1 layers" in result.output
    return out


@pytest.fixture(scope="module")
def generators(bundle):
    return {
        "one row": SpeculativeGenerator.from_bundle(bundle, threads=1),
        "batched": SpeculativeGenerator.from_bundle(bundle, threads=1, max_batch=8),
        "portable": SpeculativeGenerator.from_bundle(
            bundle, threads=1, max_batch=8, engine="portable"
        ),
    }


def test_the_export_checks_the_head_and_the_target_s_features(bundle, sources):
    manifest = read_manifest(bundle)
    head, target = manifest.models["draft"], manifest.models["target"]
    assert head.architecture == "LlamaForCausalLMEagle3" and head.num_layers == 1
    check = head.export_check
    assert check["features_max_abs_diff"] < 1e-5
    assert check["max_abs_logit_diff"] < 1e-4  # a catch-up call and a chained step
    assert target.engines["onnxruntime"].io.features == "eagle_features"
    assert head.io.hidden_states and head.io.hidden_out
    assert head.source == str(sources[2].resolve())


def test_the_portable_graphs_compute_the_features_and_the_head(bundle):
    """Standard ops only, checked against PyTorch at export, with what onnxruntime's TensorRT
    provider needs to compile them: a shape range for every input, the head's features too."""
    manifest = read_manifest(bundle)
    target, head = manifest.models["target"], manifest.models["draft"]
    assert target.path == "target/model.onnx" and target.io.features == "eagle_features"
    assert head.path == "draft/model.onnx" and head.cache == "concat"
    assert target.export_check["features_max_abs_diff"] < 1e-5
    assert target.export_check["max_abs_logit_diff"] < 1e-4
    assert head.export_check["max_abs_logit_diff"] < 1e-4
    assert set(head.engines) == {"onnxruntime"}
    for role, spec in manifest.models.items():
        graph = onnx.load(str(bundle / spec.path), load_external_data=False).graph
        assert {node.domain for node in graph.node} <= {"", "ai.onnx"}, role
        options = ep_options(spec, bundle, role, max_length=64)
        ranges = [parse(options[f"trt_profile_{key}_shapes"]) for key in ("min", "opt", "max")]
        assert sorted(name for name, _ in ranges[0]) == sorted([i.name for i in graph.input] * 2)
        for (name, low), (_, opt), (_, high) in zip(*ranges):
            assert all(a <= b <= c for a, b, c in zip(low, opt, high)), (name, low, high)
            if name == head.io.hidden_states:
                assert low[-1] == high[-1] == 64  # the head's hidden size
    result = CliRunner().invoke(main, ["build", "--bundle", str(bundle), "--tensorrt"])
    assert (
        result.exit_code != 0 and "not built for a bundle drafted for by an EAGLE" in result.output
    )
    assert "Traceback" not in result.output


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_heads_of_other_families_draft_on_the_portable_graphs(tmp_path, family):
    """The features found in another family's portable graph (Gemma 2: its scaled embedding
    read as layer 0's input), and Gemma 2's portable graphs run one row per call (a padded past
    moves their logits), so a batch of them runs a row at a time."""
    target, _ = make_tiny_pair(family, tmp_path / "src", seed=5, config=LAYERS)
    head = make_tiny_head(target, tmp_path / "head", seed=1, layers=(0, 2, 3))
    manifest = export_bundle(target, head, tmp_path / "bundle", draft_precision="float32")
    assert manifest.models["target"].export_check["features_max_abs_diff"] < 1e-5
    generator = SpeculativeGenerator.from_bundle(
        tmp_path / "bundle", threads=1, max_batch=4, engine="portable"
    )
    assert generator.max_batch == (1 if family == "gemma2" else 4)
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    alone = generator.generate(PROMPTS[:3], replace(config, num_draft_tokens=0))
    drafted = generator.generate(PROMPTS[:3], replace(config, num_draft_tokens=3, **MODEL_DRAFTS))
    assert [r.token_ids for r in drafted] == [r.token_ids for r in alone]
    assert sum(r.stats.drafted_tokens for r in drafted) > 0


@pytest.mark.parametrize("family", ["gpt2", "gemma"])
def test_a_head_trained_for_a_family_unlike_llama_drafts_losslessly(tmp_path, family):
    """`specrt distill --kind eagle3` then `specrt export --eagle` on families whose configs
    and norms are not Llama's: GPT-2 names its sizes otherwise (the command stopped on a
    traceback) and its engine computes the head's features; Gemma's final norm scales by one
    plus its weight, the scale the head's norm starts from."""
    from specrt.distill.eagle import new_head

    target, _ = make_tiny_pair(family, tmp_path / "src", seed=5, config=LAYERS)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    head = tmp_path / "head"
    args = ["distill", "--target", str(target), "--out", str(head), "--kind", "eagle3"]
    args += ["--prompt-file", str(prompts), "--max-new-tokens", "8", "--steps", "2"]
    result = CliRunner().invoke(main, [*args, "--head-vocab", str(HEAD_VOCAB)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "bundle"
    args = ["export", "--target", str(target), "--eagle", str(head), "--out", str(out)]
    result = CliRunner().invoke(main, [*args, "--draft-precision", "float32"])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    assert manifest.models["target"].export_check["features_max_abs_diff"] < 1e-5
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    for engine in ("auto", "portable"):
        generator = SpeculativeGenerator.from_bundle(out, threads=1, engine=engine)
        alone = generator.generate(PROMPTS[:3], replace(config, num_draft_tokens=0))
        drafted = generator.generate(
            PROMPTS[:3], replace(config, num_draft_tokens=3, **MODEL_DRAFTS)
        )
        assert [r.token_ids for r in drafted] == [r.token_ids for r in alone], engine
        assert sum(r.stats.drafted_tokens for r in drafted) > 0

    model = AutoModelForCausalLM.from_pretrained(target)
    if family == "gemma":
        with torch.no_grad():
            model.model.norm.weight.normal_()  # tiny Gemmas start at w = 0: made visible
        expected = 1 + model.model.norm.weight
    else:
        expected = model.transformer.ln_f.weight
    torch.testing.assert_close(new_head(model, [], 8).norm.weight, expected)


@pytest.mark.parametrize("variant", ["default layers", "norm before residual"])
def test_heads_of_either_variant_export_within_the_check(tmp_path, variant):
    """The authors' default layers (2, L/2, L-3: a target of 8 layers) read from a config
    without ids; the variant whose residual starts from the normed features."""
    default = variant == "default layers"
    layers = dict(num_hidden_layers=8 if default else 4)
    target, _ = make_tiny_pair("llama", tmp_path / "src", seed=2, config=layers)
    head = make_tiny_head(
        target, tmp_path / "head", layers=None if default else (1, 2, 3),
        norm_before_residual=not default,
    )  # fmt: skip
    manifest = export_bundle(target, head, tmp_path / "bundle")
    engine = manifest.models["draft"].engines["onnxruntime"]
    assert engine.precision == "int8"  # a draft's default: checked in float32 first
    assert engine.export_check["float32_max_abs_logit_diff"] < 1e-4
    assert 0 < engine.export_check["max_abs_logit_diff"] < 1.0
    graph = onnx.load(str(tmp_path / "bundle" / engine.path), load_external_data=False)
    kinds = {node.op_type for node in graph.graph.node}
    assert "MatMulNBits" in kinds and "MatMul" not in kinds
    assert "Pad" not in kinds  # a head over the whole vocabulary, in order: no mapping
    generator = SpeculativeGenerator.from_bundle(tmp_path / "bundle", threads=1)
    # the head drafts every round (the default's guard may switch a random head off at once;
    # a random head's drafts may all be refused: what is checked is the output, exact)
    settings = dict(max_new_tokens=24, proposer="model", draft_schedule="fixed")
    alone, drafted = (
        generator.generate(PROMPTS[:3], GenerationConfig(num_draft_tokens=k, **settings))
        for k in (0, 4)
    )
    assert [r.token_ids for r in drafted] == [r.token_ids for r in alone]
    assert sum(r.stats.drafted_tokens for r in drafted) >= 3 * 4
    if default:
        config = AutoModelForCausalLM.from_pretrained(target).config
        assert read_head(head, config).layers == (2, 4, 5)


def test_a_head_s_vocabulary_in_any_order_lands_at_the_target_s_ids(sources, tmp_path):
    """The graph writes the head's logits at the target's ids by a scatter: checked against
    PyTorch at export (``max_abs_logit_diff`` over the target's whole vocabulary) where the
    head's columns are in the target's order (the module's head), out of it, and where one maps
    past the vocabulary (left out); the output stays the target alone's."""
    from safetensors.torch import load_file, save_file

    _, target, head = sources
    weights = load_file(str(head / "model.safetensors"))
    order = torch.arange(HEAD_VOCAB).flip(0)  # the head's columns in reverse
    ids = (torch.arange(HEAD_VOCAB) + weights["d2t"])[order]  # the target id of each column
    reversed_head = {**weights, "lm_head.weight": weights["lm_head.weight"][order].contiguous()}
    heads = {"in order": head}
    for name, past in (("reversed", None), ("one left out", 10_000)):  # past: no such token
        heads[name] = tmp_path / name
        shutil.copytree(head, heads[name])
        mapped = ids.clone()
        if past is not None:
            mapped[0] = past
        edited = {**reversed_head, "d2t": mapped - torch.arange(HEAD_VOCAB)}
        save_file(edited, str(heads[name] / "model.safetensors"))
    for out, source in heads.items():
        manifest = export_bundle(target, source, tmp_path / f"{out} bundle", portable=False)
        check = manifest.models["draft"].export_check
        assert check["float32_max_abs_logit_diff"] < 1e-4, out
        graph = onnx.load(str(tmp_path / f"{out} bundle" / "draft/onnxruntime/model.onnx"),
                          load_external_data=False)  # fmt: skip
        kinds = [node.op_type for node in graph.graph.node]
        assert "ScatterElements" in kinds  # the embedding's Gather, and where a column is
        assert kinds.count("Gather") == 1 + (out == "one left out")  # left out, the kept ones'
        generator = SpeculativeGenerator.from_bundle(tmp_path / f"{out} bundle", threads=1)
        settings = dict(max_new_tokens=16, **MODEL_DRAFTS)
        alone, drafted = (
            generator.generate(PROMPTS[:2], GenerationConfig(num_draft_tokens=k, **settings))
            for k in (0, 3)
        )
        assert [r.token_ids for r in drafted] == [r.token_ids for r in alone]


def test_a_head_that_does_not_fit_its_target_is_refused_in_one_line(sources, tmp_path):
    _, target, head = sources
    wrong = tmp_path / "wrong"
    shutil.copytree(head, wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1]  # fc reads three
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="does not fit this target: fc takes 192 features"):
        export_bundle(target, wrong, tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()
    (wrong / "model.safetensors").unlink()
    args = ["export", "--target", str(target), "--eagle", str(wrong), "--out", str(tmp_path / "b")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and "has no weights" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(main, [*args, "--draft", str(target)])
    assert result.exit_code != 0 and "either --draft or --eagle" in result.output


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ({"eagle_aux_hidden_state_layer_ids": "0,1"}, 'is "0,1", not a list of integers'),
        ({"num_attention_heads": 3}, "its weights do not match its config.json"),
        ({"hidden_size": "wide"}, "config.json"),
        ({"num_hidden_layers": 2}, "num_hidden_layers is 2; an EAGLE-3 head is one decoder"),
        ({"draft_vocab_size": 32000}, "draft_vocab_size is 32000 and its lm_head has 40 rows"),
        ("truncate", "model.safetensors cannot be read"),
    ],
)
def test_a_damaged_head_is_one_line_before_the_target_is_exported(sources, tmp_path, damage,
                                                                   message):  # fmt: skip
    """A head's config or weights that cannot make its module ended in a traceback, the
    shapes' only after the target's export (minutes for a large one)."""
    _, target, head = sources
    bad = tmp_path / "bad"
    shutil.copytree(head, bad)
    if damage == "truncate":
        weights = bad / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        config = json.loads((bad / "config.json").read_text())
        config.update(damage)
        if "eagle_aux_hidden_state_layer_ids" in damage:  # read at the top level, then
            config.pop("eagle_config", None)
        (bad / "config.json").write_text(json.dumps(config))
    args = ["export", "--target", str(target), "--eagle", str(bad), "--out", str(tmp_path / "b")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and message in result.output, result.output
    assert "Traceback" not in result.output and "exporting target" not in result.output
    assert not (tmp_path / "b").exists()


def test_a_head_trained_for_another_target_precision_is_noted_at_export(sources, tmp_path):
    """`specrt distill --target-precision` records whose engine the head learnt from; exported
    with a target of another precision it drafts all the same, and the export says so."""
    _, target, head = sources
    trained = tmp_path / "head"
    shutil.copytree(head, trained)
    report = trained / "distill_report.json"
    args = ["export", "--target", str(target), "--eagle", str(trained), "--no-portable"]
    for precision, bundle_precision, noted in [
        ("int4/32", "float32", True),
        ("int4/32", "int4", False),
        ("float32", "int4", True),
    ]:
        report.write_text(json.dumps({"kind": "eagle3", "target_precision": precision}))
        out = tmp_path / f"{precision.replace('/', '-')}-{bundle_precision}"
        made = [*args, "--out", str(out), "--target-precision", bundle_precision]
        result = CliRunner().invoke(main, made)
        assert result.exit_code == 0, result.output
        assert ("trained for the " + precision in result.output) == noted, result.output


def test_specrt_build_rebuilds_a_head_s_bundle_from_its_target_and_head(sources, tmp_path):
    """In another precision, in place (a user's file in it kept), with GPU engines too;
    refused in one line where the head changed since, the bundle left as it was."""
    _, target, head = sources
    copy = tmp_path / "head"
    shutil.copytree(head, copy)
    out = tmp_path / "bundle"
    export_bundle(target, copy, out, draft_precision="float32", portable=False)
    (out / "NOTES.md").write_text("mine")
    result = CliRunner().invoke(main, ["build", "--bundle", str(out), "--draft-vocab", "24"])
    assert result.exit_code != 0 and "whose vocabulary is its own" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(main, ["build", "--bundle", str(out), "--draft-precision", "int8"])
    assert result.exit_code == 0, result.output
    assert "draft: engines onnxruntime (int8)" in result.output
    manifest = read_manifest(out)
    assert manifest.models["draft"].engines["onnxruntime"].precision == "int8"
    assert manifest.models["target"].engines["onnxruntime"].io.features == "eagle_features"
    assert manifest.models["target"].cache == "batched"  # still without portable graphs
    assert (out / "NOTES.md").read_text() == "mine"
    generator = SpeculativeGenerator.from_bundle(out, threads=1)
    alone, drafted = (
        generator.generate(PROMPTS[:2], GenerationConfig(max_new_tokens=16, num_draft_tokens=k))
        for k in (0, 3)
    )
    assert [r.token_ids for r in drafted] == [r.token_ids for r in alone]
    result = CliRunner().invoke(main, ["build", "--bundle", str(out), "--device", "cuda"])
    assert result.exit_code == 0, result.output
    assert "draft: engines onnxruntime (int8), cuda (float16)" in result.output
    assert (out / "NOTES.md").read_text() == "mine"
    before = sorted(p.name for p in out.rglob("*"))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    result = CliRunner().invoke(main, ["build", "--bundle", str(out)])
    assert result.exit_code != 0 and "draft checkpoint at" in result.output
    assert "changed since this bundle was exported" in result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in out.rglob("*")) == before


@pytest.mark.parametrize("engine", ["auto", "portable"])
def test_the_head_drafts_what_its_pytorch_reference_drafts_round_after_round(
    sources, bundle, engine
):
    """Two rows in shared calls, rounds that keep a random part of their drafts: the runtime's
    drafts (the target's features of verified positions, the head's own state while chaining,
    its cache rolled back to verified slots) are the PyTorch head's, recomputed from scratch,
    on the engines and on the portable graphs."""
    _, target_dir, head_dir = sources
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    head = read_head(head_dir, model.config)
    reference = Eagle3Head.from_checkpoint(head, model.get_input_embeddings().weight.detach())
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1, max_batch=2, engine=engine)
    kinds = {"auto": "BatchedDecoder", "portable": "PortableRowsDecoder"}
    assert type(generator.draft.head).__name__ == kinds[engine]
    target, draft = generator.target, generator.draft
    vocab = draft.vocab_size
    columns = vocab_map(head.weights["d2t"].numpy(), vocab)
    rng = np.random.default_rng(0)
    rows = [
        RowRound(tokens, SamplingParams(), rng, k=3)
        for tokens in generator.encode_prompts(["Simple is better", "def f"])
    ]
    target.prefill_rows(0, [row.tokens[:-1] for row in rows])
    k = 3
    for _ in range(6):
        catch_up(draft, rows)
        drafts, _ = draft_rows(draft, rows, k)
        for i, row in enumerate(rows):
            assert drafts[i].tolist() == _reference_chain(model, reference, head, row.tokens, k,
                                                          columns)  # fmt: skip
        # verification's part: the target reads the proposal, part of it stands
        ids = np.concatenate([[[row.tokens[-1]] for row in rows], drafts], axis=1)
        target.forward_rows(ids, keep_last=1)
        for i, row in enumerate(rows):
            kept = int(rng.integers(0, k + 1))
            row.tokens += [*drafts[i, :kept].tolist(), int(rng.integers(3, vocab))]
            target.set_length(i, len(row.tokens) - 1)
            draft.set_length(i, len(row.tokens) - 1)


def test_a_long_prompt_the_head_reads_at_admission_is_read_as_a_catch_up_reads_it(
    bundle, monkeypatch
):
    """Prompts longer than a prefill chunk (8 here, 256 in use) admitted where the head reads
    them at once (a fixed K): it reads token t into slot t - 1 as a catch-up does (it read
    each a slot early), so its cache then holds what reading them later gives."""
    from specrt.backends import base, eagle
    from specrt.backends import rows as rows_module

    for module in (base, rows_module, eagle):
        monkeypatch.setattr(module, "PREFILL_CHUNK", 8)
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1, max_batch=2)
    draft = generator.draft
    config = GenerationConfig(max_new_tokens=8, num_draft_tokens=3, **MODEL_DRAFTS)
    prompts = generator.encode_prompts([" ".join(PROMPTS[5:9]), PROMPTS[3]])
    caches = []
    for at_admission in (True, False):
        monkeypatch.setattr(BatchRunner, "_model_drafts", lambda *_, now=at_admission: now)
        runner = BatchRunner(generator.target, draft, generator.tokenizer, frozenset())
        runner.add([Request(i, p, config) for i, p in enumerate(prompts)])
        assert (draft.lengths[:2] > 8).tolist() == [at_admission] * 2
        catch_up(draft, [row.round for row in runner.rows])  # (all but its last 8 at most)
        held = draft.head.lengths[:2].tolist()
        caches.append((held, [buffer[:2].copy() for buffer in draft.head._buffers]))
    (held, admitted), (later, caught_up) = caches
    for row, slots in enumerate(np.minimum(held, later).tolist()):
        assert slots >= 16
        for a, b in zip(admitted, caught_up):
            np.testing.assert_allclose(a[row, :slots], b[row, :slots], atol=1e-5, rtol=0)


def _reference_chain(model, reference, head, tokens: list[int], k: int, columns) -> list[int]:
    """The head's K greedy drafts after ``tokens`` in PyTorch, without a cache: features of
    every position the target holds (all but the newest token), then the head's own."""
    held = len(tokens) - 1
    features = target_features(model, tokens[:held], head)
    ids, drafted = list(tokens[1:]), []
    for step in range(k):
        positions = torch.arange(held + step)
        logits, hidden = reference(features, torch.tensor(ids), positions)
        token = int(_on_target_vocab(logits[-1:].numpy(), columns).argmax())
        drafted.append(token)
        features = torch.cat([features, hidden[-1:]])
        ids.append(token)
    return drafted


@pytest.mark.parametrize("path", ["one row", "batched", "portable"])
def test_greedy_output_equals_the_target_alone(generators, path):
    generator = generators[path]
    prompts = PROMPTS[:12]

    def run(**options):
        config = GenerationConfig(max_new_tokens=40, ignore_eos=True, **options)
        if path != "one row":
            return [r.token_ids for r in generator.generate(prompts, config)]
        return [generator.generate([p], config)[0].token_ids for p in prompts]

    alone = run(num_draft_tokens=0)
    for options in (dict(MODEL_DRAFTS, num_draft_tokens=4), dict(MODEL_DRAFTS, num_draft_tokens=1),
                    {}):  # fmt: skip
        generator.forget_learning()
        assert run(**options) == alone, options


@pytest.mark.parametrize("path", ["one row", "batched", "portable"])
def test_seeded_sampling_equals_the_target_alone(generators, path):
    generator = generators[path]
    sampled = dict(max_new_tokens=40, ignore_eos=True, temperature=1.0, seed=11)
    prompts = PROMPTS[:8]
    alone = generator.generate(prompts, GenerationConfig(num_draft_tokens=0, **sampled))
    results = generator.generate(prompts, GenerationConfig(**sampled, **MODEL_DRAFTS))
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]
    accepted = sum(r.stats.accepted_tokens for r in results)
    assert 0 < accepted < sum(r.stats.drafted_tokens for r in results)


@pytest.mark.parametrize("path", ["one row", "batched", "portable"])
def test_sampled_tokens_follow_the_target(generators, path):
    """The 2nd new token is the first one the head drafts and rejection sampling decides;
    its law is computed from the target alone (its engine, one prefix at a time)."""
    generator = generators[path]
    prompt = generator.encode_prompts(["Simple is"])[0]
    expected = _second_token_law(generator.target, prompt, temperature=1.0)
    assert expected.max() > 0.05  # far from uniform over ~60 tokens
    config = GenerationConfig(max_new_tokens=3, num_draft_tokens=2, ignore_eos=True,
                              temperature=1.0, **MODEL_DRAFTS)  # fmt: skip
    streams = (np.random.default_rng([7, i]) for i in range(SAMPLES))
    results = dict(generator.run(Request(i, prompt, config, r) for i, r in enumerate(streams)))
    drafted = sum(r.stats.drafted_tokens for r in results.values())
    accepted = sum(r.stats.accepted_tokens for r in results.values())
    assert 0.2 < accepted / drafted < 0.95  # the accept and the reject paths both run
    second = np.array([results[i].token_ids[1] for i in range(SAMPLES)])
    counts = np.bincount(second, minlength=len(expected))
    assert chi_square_pvalue(counts, expected) > ALPHA


@pytest.mark.parametrize("path", ["batched", "portable"])
def test_rows_of_one_prompt_read_it_once_and_draft_from_its_features(generators, path):
    """Rows admitted with one prompt copy the first one's caches, the target's features for
    the head included: each row is what the target alone gives it one row at a time, and
    greedy rows of one prompt draft alike."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=5)):
        config = GenerationConfig(max_new_tokens=30, ignore_eos=True, **sampling)
        alone = generators["one row"].generate(prompts, replace(config, num_draft_tokens=0))
        results = generators[path].generate(prompts, replace(config, **MODEL_DRAFTS))
        assert [r.token_ids for r in results] == [r.token_ids for r in alone]
        kept = [r.stats.accepted_tokens for r in results]
        assert kept[2] > 0 and kept[3] > 0
        if config.greedy:  # the same drafts round after round: the head's state was copied
            assert kept[0] == kept[2] == kept[3] and kept[1] == kept[4]


@pytest.mark.parametrize("path", ["batched", "portable"])
def test_a_row_that_shares_a_running_row_s_beginning_gets_its_features(generators, path):
    """A row admitted while another runs, their prompts sharing 20 tokens: the target's cache
    and the head's features of those positions are copied from the running row, and are what
    reading the prompt alone gives; each row is the target alone's."""
    generator = generators[path]
    system = generator.encode_prompts([" ".join(PROMPTS[5:9])])[0]
    ids = [system + generator.encode_prompts([p])[0][1:] for p in PROMPTS[2:4]]
    ids[1] = system[:20] + ids[1][len(system) :]
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True, **MODEL_DRAFTS)
    target = generator.target
    runner = generator.runner()
    runner.add([Request(0, ids[0], config)])
    runner.step()
    fed, call = {"target": 0}, target._call
    target._call = counted(call, fed, "target")
    try:
        runner.add([Request(1, ids[1], config)])
    finally:
        target._call = call
    assert fed["target"] == len(ids[1]) - 20
    # the head's slots of those 20 tokens are the running row's: it reads only the rest
    assert generator.draft.lengths[:2].tolist() == [len(ids[0]) + 1, 20]
    shared = target.features[1, : len(ids[1])].copy()
    results = dict(runner.run([]))
    alone = generators["one row"].generate(ids, replace(config, num_draft_tokens=0))
    assert [results[i].token_ids for i in range(2)] == [r.token_ids for r in alone]
    check = generator.runner()
    check.add([Request(1, ids[1], config)])  # read alone, in slot 0
    np.testing.assert_allclose(shared, target.features[0, : len(ids[1])], atol=1e-5, rtol=0)
    list(check.run([]))
    assert np.abs(shared).max() > 0


@pytest.mark.parametrize("path", ["batched", "portable"])
def test_a_prompt_that_begins_as_a_finished_row_gets_its_features(generators, path):
    """Requests one after another with one system prompt: the finished row's features stay
    with its kept cache (moved to a free slot, then copied to the next row's), and are what
    reading the prompt alone gives; each row is the target alone's."""
    generator = generators[path]
    system = generator.encode_prompts([" ".join(PROMPTS[5:9])])[0]
    ids = [system + generator.encode_prompts([p])[0][1:] for p in PROMPTS[2:4]]
    config = GenerationConfig(max_new_tokens=30, ignore_eos=True, **MODEL_DRAFTS)
    target = generator.target
    runner = generator.runner()
    [(_, first)] = runner.run([Request(0, ids[0], config)])
    runner.add([Request(1, ids[1], config)])
    second = runner.rows[0].stats
    assert second.cached_tokens >= len(system)
    copied = target.features[0, : len(ids[1])].copy()
    [(_, result)] = runner.run([])
    alone = generators["one row"].generate(ids, replace(config, num_draft_tokens=0))
    assert [first.token_ids, result.token_ids] == [r.token_ids for r in alone]
    check = generator.runner()
    check.add([Request(1, ids[1], config)])  # read alone, in slot 0
    np.testing.assert_allclose(copied, target.features[0, : len(ids[1])], atol=1e-5, rtol=0)
    list(check.run([]))
    assert np.abs(copied).max() > 0


def _second_token_law(target, prompt: list[int], temperature: float) -> np.ndarray:
    def law(ids: list[int]) -> np.ndarray:
        target.set_length(0, 0)
        logits = target.forward(ids, keep_last=1).logits[-1]
        return warp(logits[None], temperature)[0]

    first = law(prompt)
    second = np.zeros_like(first)
    for token in np.flatnonzero(first):
        second += first[token] * law(prompt + [int(token)])
    target.set_length(0, 0)
    return second


def test_the_training_time_test_chain_is_what_drafting_computes(sources):
    """`Eagle3Head.chain` (what `specrt distill --kind eagle3` trains, every position at
    once) gives at base p, step j, what drafting computes slot by slot: the target's features
    up to p, then the head's own hidden states."""
    _, target_dir, head_dir = sources
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    head = read_head(head_dir, model.config)
    reference = Eagle3Head.from_checkpoint(head, model.get_input_embeddings().weight.detach())
    tokens = np.random.default_rng(3).integers(3, 40, size=14).tolist()
    features = target_features(model, tokens, head)
    with torch.no_grad():
        chained = reference.chain(features[None], torch.tensor([tokens[1:] + [0]]), 3)
    for base in (0, 5, 9):
        slots, ids = features[: base + 1], tokens[1 : base + 2]
        for step in range(3):
            logits, hidden = reference(slots, torch.tensor(ids), torch.arange(len(ids)))
            assert torch.allclose(logits[-1], reference.logits(chained[step][0, base]), atol=1e-5)
            slots = torch.cat([slots, hidden[-1:]])
            ids.append(tokens[base + step + 2])


def test_a_recipe_names_its_head_eagle(sources, tmp_path):
    from specrt.export.recipes import resolve_recipe

    _, target, head = sources
    recipe = tmp_path / "pair.json"
    recipe.write_text(json.dumps({"target": str(target), "eagle": str(head), "atol": 0.01}))
    found_target, found_draft, out, options = resolve_recipe(recipe)
    assert (found_target, found_draft, out) == (target, head, tmp_path / "pair")
    assert options == {"atol": 0.01}


@pytest.mark.usefixtures("cuda_rule")
def test_the_head_drafts_on_the_cuda_engines(sources, tmp_path):
    """`--device cuda` builds the target's float16 engine with the head's features and the
    head's own float16 engine, each checked against PyTorch; on the device backend (CUDA's
    rule for host inputs, `tests/cuda_rule.py`) the head drafts from the features the target
    computed there: greedy and seeded output equal to the target alone, one row and batched."""
    from specrt.backends.device_rows import DeviceRowsDecoder
    from specrt.backends.eagle import EagleDraft

    _, target, head = sources
    out = tmp_path / "bundle"
    args = ["export", "--target", str(target), "--eagle", str(head), "--out", str(out)]
    result = CliRunner().invoke(main, [*args, "--device", "cpu", "--device", "cuda"])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    draft, target_spec = manifest.models["draft"], manifest.models["target"]
    assert target_spec.engines["cuda"].io.features == "eagle_features"
    cuda = draft.engines["cuda"]
    assert cuda.dtype == "float16" and cuda.provider == "CUDAExecutionProvider"
    assert cuda.export_check["max_abs_logit_diff"] <= cuda.export_check["atol"]
    assert cuda.export_check["features_max_abs_diff"] < 0.05  # float16 features
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    for batch in (1, 4):
        generator = SpeculativeGenerator.from_bundle(out, providers=providers, max_batch=batch)
        assert isinstance(generator.draft, EagleDraft)
        assert isinstance(generator.draft.head, DeviceRowsDecoder)
        assert isinstance(generator.target, DeviceRowsDecoder)
        for options in (dict(max_new_tokens=30), dict(max_new_tokens=30, temperature=1.0, seed=3)):
            config = dict(ignore_eos=True, **options)
            alone = generator.generate(PROMPTS[:6], GenerationConfig(num_draft_tokens=0, **config))
            drafted = generator.generate(PROMPTS[:6], GenerationConfig(**config, **MODEL_DRAFTS))
            assert [r.token_ids for r in drafted] == [r.token_ids for r in alone], (batch, options)


@pytest.mark.usefixtures("cuda_rule")
def test_the_demo_head_keeps_its_drafts_on_the_cuda_engines(tmp_path):
    """The shipped demo head, which drafts well: on the cuda engines (CUDA's rule) it keeps
    about as many drafts as on the CPU engines (float16 against float32 and int8: not the
    same numbers); a head reading wrong or stale features there would keep next to none."""
    from specrt.prompts import read_prompt_file

    out = tmp_path / "demo"
    export_bundle(DEMO / "target", DEMO / "head", out, devices=("cpu", "cuda"), portable=False)
    texts = read_prompt_file(DEMO / "heldout_prompts.jsonl")[:4]
    config = GenerationConfig(max_new_tokens=32, ignore_eos=True, num_draft_tokens=4,
                              **MODEL_DRAFTS)  # fmt: skip
    rates = {}
    for engine, providers in (
        ("cpu", ["CPUExecutionProvider"]),
        ("cuda", ["CUDAExecutionProvider"]),
    ):
        generator = SpeculativeGenerator.from_bundle(out, threads=1, providers=providers)
        assert getattr(generator.target, "device", "cpu") == engine
        results = generator.generate(generator.encode_prompts(texts), config)
        drafted = sum(r.stats.drafted_tokens for r in results)
        rates[engine] = sum(r.stats.accepted_tokens for r in results) / drafted
    assert rates["cpu"] > 0.3 and abs(rates["cuda"] - rates["cpu"]) < 0.1, rates

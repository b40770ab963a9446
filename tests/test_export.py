"""The exporter: one bundle per architecture, checked against PyTorch; pairs it must refuse."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig

from specrt.bundle import read_manifest
from specrt.checksums import sha256_file
from specrt.errors import ExportError, PairMismatchError
from specrt.export import ENGINE_MODEL_TYPES, export_bundle
from specrt.export.tiny import make_tiny_pair, make_tokenizer
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from tests.conftest import build_bundle


@pytest.mark.parametrize("arch", ENGINE_MODEL_TYPES)
def test_bundle_per_architecture(bundles, arch):
    root = bundles[arch]
    manifest = read_manifest(root)
    assert manifest.tokenizer.vocab_size == manifest.vocab_size == 47
    assert manifest.tokenizer.eos_token_ids == [2] and manifest.tokenizer.bos_token_id == 1
    assert (root / "tokenizer" / "tokenizer.json").is_file()
    for role in ("target", "draft"):
        spec = manifest.models[role]
        assert spec.model_type == arch and spec.num_layers == 2
        # qwen3 and gemma: head_dim set apart from hidden / heads; gemma: one kv head
        assert spec.head_dim == (32 if arch in ("qwen3", "gemma", "gemma2", "gemma3_text") else 16)
        assert spec.num_kv_heads == {"gpt2": 4, "gemma": 1}.get(arch, 2)
        assert spec.dtype == "float32" and spec.max_positions == 128
        for rel, digest in spec.files.items():
            assert sha256_file(root / rel) == digest
        check = spec.export_check
        assert check["step_tokens"] == 4  # a multi-token step on top of a past was compared
        assert 0 <= check["max_abs_logit_diff"] < 1e-4 < check["atol"]
        graph = onnx.load(str(root / spec.path))
        assert {node.domain for node in graph.graph.node} <= {"", "ai.onnx"}  # standard ops only
        inputs = [i.name for i in graph.graph.input]
        # optimum's gemma graphs count positions along the attention mask
        positions = set() if arch.startswith("gemma") else {"position_ids"}
        wanted = {"input_ids", "attention_mask"} | positions
        assert wanted <= set(inputs)
        assert len([n for n in inputs if n.startswith("past_key_values.")]) == 4
        logits = next(o for o in graph.graph.output if o.name == "logits")
        dims = [d.dim_param or d.dim_value for d in logits.type.tensor_type.shape.dim]
        assert isinstance(dims[1], str) and dims[2] == 47  # logits for every input position
        # The onnxruntime engine: fused ops, batched in-place cache, checked the same way.
        engine = spec.engines["onnxruntime"]
        assert engine.cache == "batched" and engine.vocab_size == 47
        assert engine.export_check["step_tokens"] == 4
        if role == "target":  # PyTorch's up to float rounding, itself bit for bit
            assert engine.precision == "float32"
            assert 0 <= engine.export_check["max_abs_logit_diff"] < 1e-4
            assert engine.export_check["step_vs_one_at_a_time_max_abs_diff"] == 0.0
        else:  # the default int8 draft: close, not exact (it only proposes tokens)
            assert engine.precision == "int8"
            assert 1e-4 < engine.export_check["max_abs_logit_diff"] < 2.0
        for rel, digest in engine.files.items():
            assert sha256_file(root / rel) == digest
        engine_graph = onnx.load(str(root / engine.path), load_external_data=False)
        # The oldest IR version with opset 23: onnxruntime 1.23 refuses newer ones.
        assert engine_graph.ir_version == 11
        ops = {node.op_type for node in engine_graph.graph.node}
        norm = "SkipLayerNormalization" if arch == "gpt2" else "SkipSimplifiedLayerNormalization"
        assert {"Attention", "ScatterND", norm} <= ops and "GroupQueryAttention" not in ops
        assert ("MatMulNBits" in ops) == (role == "draft")


def test_multi_position_logits_match_pytorch(bundles, tmp_path):
    """A verification-shaped call (5 tokens on top of a 7-token past) matches PyTorch."""
    generator = SpeculativeGenerator.from_bundle(bundles["qwen2"], threads=1)
    source = read_manifest(bundles["qwen2"]).models["target"].source
    model = AutoModelForCausalLM.from_pretrained(source).eval()
    ids = np.random.default_rng(2).integers(3, 47, 12).tolist()
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0].numpy()
    generator.target.reset()
    generator.target.forward(ids[:7])
    logits = generator.target.forward(ids[7:]).logits
    np.testing.assert_allclose(logits, reference[7:], atol=1e-4)


@pytest.mark.parametrize("arch", ENGINE_MODEL_TYPES)
def test_the_target_engine_verifies_bit_for_bit_what_it_decodes_alone(bundles, arch):
    """Rows of several lengths in one call, each with another count of positions fed (1 to
    5; the rest padding): every position's logits are those of the same row decoded alone one
    token at a time, to the last bit, so speculation cannot turn a near tie the other way."""
    from specrt.runtime.loading import load_pair

    batched = load_pair(bundles[arch], threads=1, max_batch=4).target
    alone = load_pair(bundles[arch], threads=1).target
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 47, n).tolist() for n in (9, 3, 14, 6)]
    fed = np.array([5, 1, 3, 2])
    new = rng.integers(3, 47, (4, 5))
    batched.prefill_rows(0, prompts)
    together = batched.forward_rows(new, keep_last=5, fed=fed).logits
    for row, prompt in enumerate(prompts):
        alone.reset()
        alone.prefill(prompt)
        for j in range(fed[row]):
            logits = alone.forward([int(new[row, j])]).logits[-1]
            assert np.array_equal(together[row, j], logits), (row, j)


def test_a_float32_target_built_within_rounding_is_named_for_a_rebuild(tmp_path, caplog):
    """A bundle whose float32 engine verifies within rounding of decoding alone (as engines
    built before their attention computed two query rows did: its export check says by how
    much) loads with one warning naming the rebuild; `specrt build` makes it bit for bit."""
    import logging

    from click.testing import CliRunner

    from specrt.cli import main

    bundle = build_bundle(tmp_path, "old", arch="llama")
    manifest_path = bundle / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    check = manifest["models"]["target"]["engines"]["onnxruntime"]["export_check"]
    assert check["step_vs_one_at_a_time_max_abs_diff"] == 0.0
    with caplog.at_level(logging.WARNING, logger="specrt"):
        SpeculativeGenerator.from_bundle(bundle, threads=1)
    assert "not bit for bit" not in caplog.text
    check["step_vs_one_at_a_time_max_abs_diff"] = 2.9e-5  # what such an engine measured
    manifest_path.write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="specrt"):
        SpeculativeGenerator.from_bundle(bundle, threads=1)
    assert "within 2.9e-05 of decoding it alone, not bit for bit" in caplog.text
    assert f"rebuild it with `specrt build --bundle {bundle}`" in caplog.text
    caplog.clear()
    result = CliRunner().invoke(main, ["build", "--bundle", str(bundle)])
    assert result.exit_code == 0, result.output
    with caplog.at_level(logging.WARNING, logger="specrt"):
        SpeculativeGenerator.from_bundle(bundle, threads=1)
    assert "not bit for bit" not in caplog.text
    engine = read_manifest(bundle).models["target"].engines["onnxruntime"]
    assert engine.export_check["step_vs_one_at_a_time_max_abs_diff"] == 0.0


def test_padded_vocabularies_are_cut_to_the_shared_tokenizer(tmp_path):
    """Real Qwen pairs pad their embeddings differently beyond the shared tokenizer."""
    bundle = build_bundle(tmp_path, "qwen", arch="qwen2", target_vocab_pad=16, draft_vocab_pad=8)
    manifest = read_manifest(bundle)
    assert manifest.models["target"].vocab_size == 47 + 16
    assert manifest.models["draft"].vocab_size == 47 + 8
    assert manifest.vocab_size == 47
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    config = dict(max_new_tokens=24, ignore_eos=True)
    prompts = ["Simple is", "def f(x):", "Flat"]
    base = generator.generate(prompts, GenerationConfig(num_draft_tokens=0, **config))
    spec = generator.generate(prompts, GenerationConfig(num_draft_tokens=3, **config))
    assert [r.token_ids for r in spec] == [r.token_ids for r in base]
    sampled = generator.generate(prompts, GenerationConfig(temperature=1.0, seed=0, **config))
    assert all(0 <= t < 47 for r in sampled for t in r.token_ids)


def test_different_tokenizers_are_refused_with_the_difference_named(tmp_path):
    target, draft = make_tiny_pair("llama", tmp_path / "src")
    make_tokenizer(extra_tokens=5).save_pretrained(draft)
    with pytest.raises(
        PairMismatchError, match="vocabulary sizes differ: target 47 tokens, draft 52"
    ):
        export_bundle(target, draft, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # same size, one token with another id
    data = json.loads((target / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(PairMismatchError, match="token 'a' has id"):
        export_bundle(target, draft, tmp_path / "out")


def test_model_smaller_than_tokenizer_is_refused(tmp_path):
    target, draft = make_tiny_pair("llama", tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(draft)
    model.resize_token_embeddings(40)
    model.save_pretrained(draft)
    with pytest.raises(PairMismatchError, match="draft model has 40 embeddings"):
        export_bundle(target, draft, tmp_path / "out")


def test_nan_model_is_refused_and_existing_bundle_survives(tmp_path, bundles):
    out = tmp_path / "bundle"
    shutil.copytree(bundles["llama"], out)
    target, draft = make_tiny_pair("llama", tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(target)
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")
    model.save_pretrained(target)
    with pytest.raises(ExportError, match="already exists and holds a bundle; pass --force"):
        export_bundle(target, draft, out)
    with pytest.raises(ExportError, match="NaN/inf logits"):
        export_bundle(target, draft, out, force=True)
    SpeculativeGenerator.from_bundle(out)  # the old bundle is intact and loads
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]  # no scratch left


def test_unsupported_or_missing_checkpoints(tmp_path):
    target, _ = make_tiny_pair("llama", tmp_path / "src")
    BertConfig().save_pretrained(tmp_path / "bert")
    with pytest.raises(ExportError, match="'bert' is not supported yet; supported: llama"):
        export_bundle(target, tmp_path / "bert", tmp_path / "out")
    with pytest.raises(ExportError, match="'.*nowhere' does not exist; check the path"):
        export_bundle(target, tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="has no config.json"):
        export_bundle(target, tmp_path / "empty", tmp_path / "out")
    (tmp_path / "src" / "draft" / "tokenizer.json").unlink()
    with pytest.raises(ExportError, match="has no tokenizer.json"):
        export_bundle(target, tmp_path / "src" / "draft", tmp_path / "out")
    for weights in (tmp_path / "src" / "draft").glob("*.safetensors"):
        weights.unlink()  # found before the target's export, not after it
    with pytest.raises(ExportError, match="draft checkpoint .* has no weights"):
        export_bundle(target, tmp_path / "src" / "draft", tmp_path / "out")


def test_checkpoints_without_an_output_layer_or_quantized_are_refused(tmp_path, capfd, caplog):
    """A base model or classifier of a supported family loaded as a causal LM gets a random
    output layer (an export check failure, or with --atol raised a bundle of random heads); a
    quantized checkpoint ended in the quantiser's ImportError traceback. One line each, before
    any export; a checkpoint with a weight removed is found at load."""
    from transformers import LlamaForSequenceClassification

    from specrt.export.tiny import tiny_config

    target, draft = make_tiny_pair("llama", tmp_path / "src")
    config = tiny_config("llama", len(make_tokenizer()), num_labels=1, pad_token_id=0)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "classifier")
    make_tokenizer().save_pretrained(tmp_path / "classifier")
    with pytest.raises(ExportError, match="is a LlamaForSequenceClassification, not a language"):
        export_bundle(target, tmp_path / "classifier", tmp_path / "out")

    shutil.copytree(draft, tmp_path / "awq")
    settings = json.loads((tmp_path / "awq" / "config.json").read_text())
    settings["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "awq" / "config.json").write_text(json.dumps(settings))
    with pytest.raises(ExportError, match=r"is quantized \(awq\); export the unquantized"):
        export_bundle(target, tmp_path / "awq", tmp_path / "out")

    model = AutoModelForCausalLM.from_pretrained(draft)
    weights = {k: v for k, v in model.state_dict().items() if not k.startswith("lm_head")}
    shutil.copytree(draft, tmp_path / "headless")
    from safetensors.torch import save_file

    save_file(weights, tmp_path / "headless" / "model.safetensors", metadata={"format": "pt"})
    capfd.readouterr()
    with pytest.raises(ExportError, match=r"lacks weights the model needs \(lm_head.weight\)"):
        export_bundle(target, tmp_path / "headless", tmp_path / "out", portable=False)
    said = capfd.readouterr().err + caplog.text
    assert "newly initialized" not in said  # the one line says it all
    assert not (tmp_path / "out").exists()

    (tmp_path / "a-file").write_text("")
    with pytest.raises(ExportError, match="a-file is a file, not a folder; choose another --out"):
        export_bundle(target, draft, tmp_path / "a-file" / "sub" / "bundle")


def test_a_multimodal_checkpoint_smaller_than_its_tokenizer_is_named(tmp_path):
    """The check read the text decoder's vocabulary, the message the top config's (which a
    multimodal config lacks): an AttributeError traceback."""
    target, draft = make_tiny_pair("gemma3", tmp_path / "src")
    settings = json.loads((target / "config.json").read_text())
    settings["text_config"]["vocab_size"] = 40
    (target / "config.json").write_text(json.dumps(settings))
    with pytest.raises(PairMismatchError, match="target model has 40 embeddings but the tokenizer"):
        export_bundle(target, draft, tmp_path / "out")


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
)
def test_the_engines_rotary_tables_are_the_models_own_computed_in_float64(scaling):
    """The engine's cos/sin tables: the model's rotary module's (its scaling applied), with the
    cosine and sine taken in float64 (torch's float32 cosine has erred by 1.5e-4 on a first
    call, failing exports now and then)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from specrt.export.ort_engine import rope_tables

    config = LlamaConfig(
        hidden_size=64, num_attention_heads=2, max_position_embeddings=256, rope_scaling=scaling
    )
    rotary = LlamaRotaryEmbedding(config)
    positions = 512 if scaling and scaling["rope_type"] == "dynamic" else 256
    cos, sin = rope_tables(rotary, positions)
    with torch.no_grad():
        own_cos, own_sin = rotary(torch.zeros(1), torch.arange(positions)[None])
    half = own_cos.shape[-1] // 2
    assert cos.shape == sin.shape == (positions, half) and cos.dtype == np.float32
    # the module's float32 angles (its inv_freq as the call left it), their cosine in float64
    angles = np.arange(positions, dtype=np.float32)[:, None] * rotary.inv_freq.numpy()
    exact = np.cos(angles.astype(np.float64)) * rotary.attention_scaling
    np.testing.assert_array_equal(cos, exact.astype(np.float32))
    np.testing.assert_allclose(cos, own_cos[0, :, :half].numpy(), atol=2e-4)
    np.testing.assert_allclose(sin, own_sin[0, :, :half].numpy(), atol=2e-5)

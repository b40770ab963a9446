"""Sliding-window attention (Mistral, Phi-3) in the onnxruntime engine: the host limits each token's
mask to the last `window` positions. Greedy output 120 tokens past a 16-token window equals
PyTorch's, through the engine and the portable graph, target-only, speculative and batched."""

from __future__ import annotations

import pytest

from specrt.bundle import read_manifest
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from tests.conftest import build_bundle

torch = pytest.importorskip("torch", reason="the export extra is not installed")
WINDOW, NEW = 16, 120
PROMPTS = ["Simple is better", "def fibonacci(n):", "Errors should never pass"]


@pytest.fixture(scope="module", params=["mistral", "phi3"])
def bundle(tmp_path_factory, request):
    return build_bundle(
        tmp_path_factory.mktemp("window"),
        "pair",
        arch=request.param,
        seed=11,
        max_positions=256,
        sliding_window=WINDOW,
    )


@pytest.fixture(scope="module")
def pytorch_greedy(bundle):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bundle.parent / "pair-src" / "target").eval()
    model.generation_config.eos_token_id = None  # run the whole length, as ignore_eos does
    assert model.config.sliding_window == WINDOW
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    outputs = []
    for ids in generator.encode_prompts(PROMPTS):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=0
            )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


def test_the_engine_carries_the_window(bundle):
    for spec in read_manifest(bundle).models.values():
        engine = spec.engines["onnxruntime"]  # built, not left to the portable graph
        assert engine.sliding_window == WINDOW


@pytest.mark.parametrize("engine", ["onnxruntime", "portable"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_past_the_window_equals_pytorch(bundle, pytorch_greedy, engine, batch):
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1, engine=engine, max_batch=batch)
    for k in (0, 3):
        config = GenerationConfig(max_new_tokens=NEW, num_draft_tokens=k, ignore_eos=True)
        results = generator.generate(PROMPTS, config)
        assert [r.token_ids for r in results] == pytorch_greedy, (engine, batch, k)
        if k:
            drafted = sum(r.stats.drafted_tokens for r in results)
            assert 0 < sum(r.stats.accepted_tokens for r in results) < drafted


def test_without_the_window_the_output_differs(bundle, pytorch_greedy):
    """The test can fail: the same engine with the window switched off decodes otherwise."""
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1, max_batch=1)
    generator.target.window = None
    config = GenerationConfig(max_new_tokens=NEW, num_draft_tokens=0, ignore_eos=True)
    results = generator.generate(PROMPTS, config)
    assert [r.token_ids for r in results] != pytorch_greedy

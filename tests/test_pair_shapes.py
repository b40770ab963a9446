"""Pairs whose members differ in hidden size, layers, heads, kv heads and head_dim, as every
real pair does: each family exports such a pair, and speculative greedy output equals the
target's alone, one row at a time and batched."""

from __future__ import annotations

import pytest

from specrt.bundle import read_manifest
from specrt.export import ENGINE_MODEL_TYPES
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from tests.conftest import build_bundle
from tests.test_greedy import PROMPTS

# A draft of a quarter of the target's width and half its layers (head_dim 16 everywhere: what
# onnxruntime's attention kernels need).
SMALL = {"layers": 1, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}
SMALL_BY_ARCH = {
    "gpt2": {"layers": 1, "n_embd": 32, "n_head": 2},
    "qwen3": {**SMALL, "head_dim": 16},
    "gemma": {**SMALL, "head_dim": 16},
}


@pytest.mark.parametrize("arch", ENGINE_MODEL_TYPES)
def test_a_smaller_draft_of_another_shape(tmp_path, arch):
    dims = SMALL_BY_ARCH.get(arch, SMALL)
    bundle = build_bundle(tmp_path, "pair", arch=arch, seed=4, draft_dims=dims)
    models = read_manifest(bundle).models
    assert models["draft"].num_layers == 1 < models["target"].num_layers
    draft, target = models["draft"], models["target"]
    assert (draft.num_kv_heads, draft.head_dim) != (target.num_kv_heads, target.head_dim)
    assert "onnxruntime" in models["draft"].engines and "onnxruntime" in models["target"].engines
    alone = SpeculativeGenerator.from_bundle(bundle, threads=1)
    expected = alone.generate(PROMPTS, GenerationConfig(max_new_tokens=24, num_draft_tokens=0))
    for batch in (1, 4):
        generator = SpeculativeGenerator.from_bundle(bundle, threads=1, max_batch=batch)
        results = generator.generate(
            PROMPTS, GenerationConfig(max_new_tokens=24, num_draft_tokens=3)
        )
        assert [r.token_ids for r in results] == [r.token_ids for r in expected], batch
        assert sum(r.stats.drafted_tokens for r in results) > 0

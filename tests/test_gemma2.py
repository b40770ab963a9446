"""Gemma 2 and Gemma 3 (text) through their portable graphs: local (sliding-window) and global
layers in turn, (1 + w) norms before and after each block; Gemma 2 soft-caps attention scores
and logits, Gemma 3 normalises q and k and gives local layers their own rope base. No
onnxruntime engine is built for them yet, and their rows run one per call (Gemma 2's graph
does not mask a padded past exactly), so a batch loads as one row at a time."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specrt.bundle import read_manifest
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from tests.conftest import build_bundle

WINDOW = 16
PROMPTS = ["Simple is better", "def f(x):\n    return x", "a b c a b"]
NEW = 100  # well past the window


@pytest.fixture(scope="module", params=["gemma2", "gemma3_text"])
def windowed(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return build_bundle(root, "pair", arch=request.param, seed=3, sliding_window=WINDOW)


def greedy_by_pytorch(checkpoint, prompt: list[int], new: list[int]) -> list[int]:
    """The argmax at every position of ONE full PyTorch pass over prompt + new: what greedy
    decoding must have chosen (transformers' own cached `generate` differs from its full pass
    past the window on these models)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + new])).logits[0]
    return logits[len(prompt) - 1 : -1].argmax(-1).tolist()


def test_export_checks_the_portable_graph_and_builds_no_engine(windowed):
    for role in ("target", "draft"):
        spec = read_manifest(windowed).models[role]
        assert spec.model_type.startswith("gemma") and spec.head_dim == 32
        assert 0 <= spec.export_check["max_abs_logit_diff"] < 1e-4
        assert spec.export_check["step_tokens"] == 4
        assert not spec.engines


def test_greedy_past_the_window_is_the_models_own(windowed):
    generator = SpeculativeGenerator.from_bundle(windowed, threads=1)
    config = GenerationConfig(max_new_tokens=NEW, num_draft_tokens=0, ignore_eos=True)
    results = generator.generate(PROMPTS, config)
    source = read_manifest(windowed).models["target"].source
    for prompt, result in zip(generator.encode_prompts(PROMPTS), results):
        assert len(prompt) + NEW > 3 * WINDOW
        assert result.token_ids == greedy_by_pytorch(source, prompt, result.token_ids)


def test_the_window_matters(windowed, tmp_path):
    """The same weights without the window decode otherwise: the test above can fail."""
    arch = read_manifest(windowed).models["target"].model_type
    wide = build_bundle(tmp_path, "wide", arch=arch, seed=3)
    config = GenerationConfig(max_new_tokens=NEW, num_draft_tokens=0, ignore_eos=True)
    outputs = [
        [
            r.token_ids
            for r in SpeculativeGenerator.from_bundle(b, threads=1).generate(PROMPTS, config)
        ]
        for b in (windowed, wide)
    ]
    assert outputs[0] != outputs[1]


@pytest.mark.parametrize(
    "options",
    [
        dict(num_draft_tokens=4),
        dict(num_draft_tokens=4, draft_schedule="adaptive"),
        dict(proposer="lookup"),
        dict(proposer="hybrid", draft_schedule="adaptive"),
    ],
)
def test_speculative_greedy_equals_target_alone(windowed, options):
    expected = None
    for max_batch in (1, 4):
        generator = SpeculativeGenerator.from_bundle(windowed, threads=1, max_batch=max_batch)
        assert generator.max_batch == 1  # one row per call, whatever was asked
        if expected is None:
            alone = GenerationConfig(max_new_tokens=NEW, num_draft_tokens=0, ignore_eos=True)
            expected = [r.token_ids for r in generator.generate(PROMPTS, alone)]
        config = GenerationConfig(max_new_tokens=NEW, ignore_eos=True, **options)
        results = generator.generate(PROMPTS, config)
        assert [r.token_ids for r in results] == expected
        proposed = sum(r.stats.drafted_tokens for r in results)
        accepted = sum(r.stats.accepted_tokens for r in results)
        assert 0 < accepted < proposed

"""Every family with the features its real checkpoints carry (rope scaling types, tied
embeddings, biases, head_dim apart from hidden / heads, sliding windows narrower than what is
generated, soft-capping, local and global layers): greedy output 120 tokens long equals
PyTorch's, through the portable graph and through each engine, target-only and speculative, one
row and batched. A feature an engine cannot fuse leaves that model on its portable graph, and
the export says which feature it was."""

from __future__ import annotations

import pytest

from specrt.bundle import read_manifest
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from tests.conftest import build_bundle

torch = pytest.importorskip("torch", reason="the export extra is not installed")
WINDOW, NEW = 16, 120
PROMPTS = ["Simple is better", "def fibonacci(n):\n    return", "a b c a b"]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
# name: (arch, the config's features, sliding window, why the engine refuses it or None)
FAMILIES = {
    "llama-llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "llama-linear-rope-biases": (
        "llama",
        {
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    "qwen2-yarn-window": ("qwen2", {"rope_scaling": YARN_ROPE}, WINDOW),
    "qwen3": ("qwen3", {}),
    "mistral-window": ("mistral", {}, WINDOW),
    "phi3-window": ("phi3", {}, WINDOW),
    # Phi-4-mini: 3/4 of each head rotates (48 of 64), longrope (short factors up to 192
    # positions, its original length here: the engine stops there), tied embeddings
    "phi4-mini-partial-rotary-longrope": (
        "phi3",
        {
            "hidden_size": 256,
            "partial_rotary_factor": 0.75,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "type": "longrope",
                "short_factor": [1.0 + i / 24 for i in range(24)],
                "long_factor": [2.0 + i / 12 for i in range(24)],
            },
            "original_max_position_embeddings": 192,
        },
    ),
    "llama-relu": ("llama", {"hidden_act": "relu"}, None, "activation 'relu'"),
    "gemma": ("gemma", {}),
    "gemma2-window-softcap": ("gemma2", {}, WINDOW),
    "gemma3-window-local-rope": (
        "gemma3_text",
        {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        WINDOW,
    ),
    # Gemma 3 from 4B up: a vision tower beside the text decoder; the draft is text only
    "gemma3-multimodal-target": ("gemma3", {}, WINDOW),
    "gpt2": ("gpt2", {}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    arch, config, window, refused = (*FAMILIES[request.param], None, None)[:4]
    logs: list[str] = []
    bundle = build_bundle(
        tmp_path_factory.mktemp(request.param),
        "pair",
        arch=arch,
        seed=11,
        max_positions=256,
        sliding_window=window,
        config=config,
        export_options=dict(devices=("cpu", "cuda"), log=logs.append),
    )
    return request.param, bundle, window, refused, logs


def pytorch_greedy(checkpoint, prompts: list[list[int]], outputs: list[list[int]]):
    """The argmax at every position of ONE full PyTorch pass over each prompt + output: what
    greedy decoding must have chosen (transformers' own cached `generate` leaves the window
    on some of these models)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    expected = []
    for prompt, new in zip(prompts, outputs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + new])).logits[0]
        expected.append(logits[len(prompt) - 1 : -1].argmax(-1).tolist())
    return expected


def engines_of(bundle) -> list[str]:
    return ["portable", *read_manifest(bundle).models["target"].engines]


def test_engines_are_built_or_the_feature_named(family):
    name, bundle, window, refused, logs = family
    for role, spec in read_manifest(bundle).models.items():
        assert 0 <= spec.export_check["max_abs_logit_diff"] < 1e-4
        if refused:
            assert not spec.engines
            assert any(refused in line and role in line for line in logs), logs
            continue
        assert set(spec.engines) == {"onnxruntime", "cuda"}
        assert spec.engines["onnxruntime"].sliding_window == window
        # CUDA's Attention kernels refuse soft-capped scores: Gemma 2 keeps GroupQueryAttention
        softcap = FAMILIES[name][0] == "gemma2"
        assert spec.engines["cuda"].cache == ("in_place" if softcap else "batched")
        # longrope: exact up to its original length, where its table changes
        limit = 192 if "longrope" in name else None
        assert (
            spec.engines["onnxruntime"].max_positions == spec.engines["cuda"].max_positions == limit
        )
        if limit:  # the engine stops where its table would change (the portable graph not)
            generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
            config = GenerationConfig(max_new_tokens=400, ignore_eos=True)
            [result] = generator.generate(["Simple is"], config)
            assert result.finish_reason == "length"
            assert result.stats.prompt_tokens + result.stats.new_tokens == limit
        if role == "target":
            check = spec.engines["onnxruntime"].export_check
            assert 0 <= check["max_abs_logit_diff"] < 1e-4
            assert check["step_vs_one_at_a_time_max_abs_diff"] == 0.0  # bit for bit
            assert 0 < spec.engines["cuda"].export_check["max_abs_logit_diff"] < 0.05


def test_greedy_equals_pytorch_on_every_graph(family):
    """The float32 graphs decode PyTorch's tokens; the float16 cuda engine (run here on the
    CPU) may round a near tie the other way, so its speculative output is held to its own
    target-only output."""
    name, bundle, window, refused, logs = family
    source = read_manifest(bundle).models["target"].source
    reference = None
    for engine in engines_of(bundle):
        expected = reference if engine != "cuda" else None
        for batch in (1, 3):
            generator = SpeculativeGenerator.from_bundle(
                bundle, threads=1, engine=engine, max_batch=batch
            )
            prompts = generator.encode_prompts(PROMPTS)
            # the target alone, the draft model at a fixed K (it must keep some drafts), and
            # the default, whose timed choices may rightly stop drafting where a draft step
            # costs what a pass does (the float16 graph run on a CPU)
            fixed = dict(proposer="model", draft_schedule="fixed")
            for k, options in ((0, {}), (3, fixed), (3, {})):
                config = GenerationConfig(
                    max_new_tokens=NEW, num_draft_tokens=k, ignore_eos=True, **options
                )
                results = generator.generate(PROMPTS, config)
                outputs = [r.token_ids for r in results]
                if reference is None:  # the first run, checked against PyTorch
                    assert all(len(prompt) + NEW > 3 * WINDOW for prompt in prompts)
                    reference = pytorch_greedy(source, prompts, outputs)
                if expected is None:
                    expected = reference if engine != "cuda" else outputs
                if engine == "cuda":
                    equal_up_to_near_ties(bundle, prompts, outputs, expected)
                else:
                    assert outputs == expected, (name, engine, batch, k)
                if options:  # (rejections on every family: tests/test_greedy.py)
                    assert sum(r.stats.accepted_tokens for r in results) > 0


def equal_up_to_near_ties(bundle, prompts, outputs, expected, margin: float = 0.01) -> None:
    """Each row equals its expected tokens, or up to a position where the two tokens' logits
    (one call over the expected prefix) are within ``margin``: a float16 engine's kernels may
    round such a near tie the other way at another call shape (rows, tokens per call)."""
    decoder = SpeculativeGenerator.from_bundle(bundle, threads=1, engine="cuda").target
    for prompt, got, want in zip(prompts, outputs, expected):
        differ = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
        if not differ:
            assert len(got) == len(want)
            continue
        at = differ[0]
        decoder.reset()
        logits = decoder.forward(prompt + want[:at], keep_last=1).logits[-1]
        gap = abs(float(logits[want[at]]) - float(logits[got[at]]))
        assert gap < margin, f"position {at}: {got[at]} instead of {want[at]}, logits {gap} apart"


def test_a_multimodal_target_is_exported_as_its_text_decoder(family):
    """The bundle holds the text decoder (the vision tower is left out), records the original
    checkpoint, and `specrt build` rebuilds its engines from that checkpoint."""
    name, bundle, window, refused, logs = family
    if FAMILIES[name][0] != "gemma3":
        pytest.skip(f"{name} is not multimodal")
    from specrt.export.build import build_engines

    spec = read_manifest(bundle).models["target"]
    assert spec.model_type == "gemma3_text" and spec.architecture == "Gemma3ForCausalLM"
    assert spec.source.endswith("target")  # the multimodal checkpoint itself
    assert any("text decoder of the multimodal checkpoint" in line for line in logs)
    assert sorted(p.name for p in bundle.iterdir()) == [
        "draft",
        "manifest.json",
        "target",
        "tokenizer",
    ]
    rebuilt = build_engines(bundle).models["target"].engines["onnxruntime"]
    assert 0 <= rebuilt.export_check["max_abs_logit_diff"] < 1e-4


def test_the_window_matters(family):
    """The same engine with the window switched off decodes otherwise: the window test above
    can fail."""
    name, bundle, window, refused, logs = family
    if window is None:
        pytest.skip(f"{name} has no sliding window")
    config = GenerationConfig(max_new_tokens=NEW, num_draft_tokens=0, ignore_eos=True)
    outputs = []
    for window_on in (True, False):
        generator = SpeculativeGenerator.from_bundle(bundle, threads=1, max_batch=1)
        if not window_on:
            generator.target.window = None
        outputs.append([r.token_ids for r in generator.generate(PROMPTS, config)])
    assert outputs[0] != outputs[1]

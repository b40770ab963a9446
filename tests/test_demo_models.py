"""The demo pair: its training script runs end to end (smoke mode), and the shipped pair exports
to a bundle whose speculative greedy output equals target-only greedy output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from specrt.export import export_bundle
from specrt.prompts import read_prompt_file
from specrt.runtime import GenerationConfig, SpeculativeGenerator

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "models" / "demo"


def heldout_prompts(limit: int) -> list[str]:
    return read_prompt_file(DEMO / "heldout_prompts.jsonl")[:limit]


def test_training_script_smoke(tmp_path):
    out = tmp_path / "demo"
    subprocess.run(
        [sys.executable, str(REPO / "models" / "train_demo.py"), "--smoke", "--out", str(out)],
        check=True,
        capture_output=True,
    )
    report = json.loads((out / "training_report.json").read_text())
    assert report["smoke"] and report["train_files"] > report["heldout_files"] > 0
    assert len((out / "heldout_prompts.jsonl").read_text().splitlines()) == 64
    # the saved tokenizer loads both ways, and both agree
    fast = PreTrainedTokenizerFast.from_pretrained(out / "tokenizer")
    raw = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    text = "def fibonacci(n):\n    return n"
    assert fast(text).input_ids == raw.encode(text).ids
    assert raw.decode(raw.encode(text).ids) == text
    export_bundle(out / "target", out / "draft", tmp_path / "bundle")
    generator = SpeculativeGenerator.from_bundle(tmp_path / "bundle", threads=1)
    options = dict(max_new_tokens=16, ignore_eos=True)
    base = generator.generate([text], GenerationConfig(num_draft_tokens=0, **options))
    spec = generator.generate([text], GenerationConfig(num_draft_tokens=3, **options))
    assert spec[0].token_ids == base[0].token_ids


@pytest.fixture(scope="module")
def demo_bundle(tmp_path_factory) -> Path:
    bundle = tmp_path_factory.mktemp("demo") / "bundle"
    export_bundle(DEMO / "target", DEMO / "draft", bundle, slim=True)  # as engines/demo.json
    return bundle


@pytest.fixture(scope="module")
def demo_generator(demo_bundle):
    return SpeculativeGenerator.from_bundle(demo_bundle)


def test_shipped_pair_is_lossless_on_heldout_prompts(demo_generator):
    prompts = heldout_prompts(12)
    options = dict(max_new_tokens=48)
    base = demo_generator.generate(prompts, GenerationConfig(num_draft_tokens=0, **options))
    spec = demo_generator.generate(prompts, GenerationConfig(num_draft_tokens=4, **options))
    for b, s in zip(base, spec):
        assert s.token_ids == b.token_ids
    emitted = sum(len(r.token_ids) for r in spec)
    rounds = sum(r.stats.rounds for r in spec)
    # the shipped pair really speculates well (MODEL_CARD.md): >= 2.3 tokens per target pass
    assert emitted / rounds >= 2.3


def test_measure_script_runs(demo_bundle, tmp_path):
    """`make measure-demo` (it once stopped on its own default of --threads)."""
    out = tmp_path / "measurements.json"
    script = REPO / "models" / "measure_demo.py"
    command = [sys.executable, str(script), "--bundle", str(demo_bundle), "--out", str(out)]
    subprocess.run([*command, "--prompts", "2", "--max-new-tokens", "8"], check=True)
    report = json.loads(out.read_text())
    assert report["greedy"]["tokens_per_round"] >= 1 and 0 < report["draft_cost_ratio"] < 1

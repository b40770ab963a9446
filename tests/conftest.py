"""Shared fixtures: real tiny checkpoints (random weights, built from configs) exported to real
ONNX bundles by the real exporter, once per test session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specrt.export import SUPPORTED_MODEL_TYPES, export_bundle
from specrt.export.tiny import make_tiny_pair
from specrt.runtime import SpeculativeGenerator
from tests.cuda_rule import batched, cuda_on_cpu


def build_bundle(root, name: str, export_options: dict | None = None, **pair_options):
    target, draft = make_tiny_pair(out_dir=root / f"{name}-src", **pair_options)
    export_bundle(target, draft, root / name, **(export_options or {}))
    return root / name


@pytest.fixture(scope="session")
def bundles(tmp_path_factory):
    """One bundle per supported architecture: {arch: bundle dir}."""
    root = tmp_path_factory.mktemp("bundles")
    return {
        arch: build_bundle(root, arch, arch=arch, seed=index, draft_noise=0.3)
        for index, arch in enumerate(SUPPORTED_MODEL_TYPES)
    }


@pytest.fixture(scope="session")
def demo_bundle(tmp_path_factory):
    """The shipped demo pair exported as `make engines` does (engines/demo.json), at a path
    ending in engines/demo, as the README's examples have it."""
    demo = Path(__file__).resolve().parents[1] / "models" / "demo"
    engines = tmp_path_factory.mktemp("demo") / "engines"
    engines.mkdir()
    export_bundle(demo / "target", demo / "draft", engines / "demo", slim=True)
    return engines / "demo"


def chat_bundle(bundle: Path, root: Path) -> Path:
    """A copy of ``bundle`` at ``root/chat`` with a chat template of its own (the tiny pairs'
    tokenizers have none): ``<role>content`` lines, then ``<assistant>``."""
    import shutil

    chat = root / "chat"
    shutil.copytree(bundle, chat)
    (chat / "tokenizer" / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return chat


@pytest.fixture(scope="session")
def llama_bundle(bundles):
    return bundles["llama"]


def generator_paths(bundle) -> dict:
    """One bundle's generators as tests compare them: one row a call, rows sharing calls, and
    the portable graph (the reference decodes written out over it)."""
    return {
        "one row": SpeculativeGenerator.from_bundle(bundle, threads=1),
        "batched": SpeculativeGenerator.from_bundle(bundle, threads=1, max_batch=4),
        "portable": SpeculativeGenerator.from_bundle(bundle, threads=1, engine="portable"),
    }


@pytest.fixture(scope="session")
def llama_generator(llama_bundle):
    return SpeculativeGenerator.from_bundle(llama_bundle, threads=1)


@pytest.fixture(scope="session", autouse=True)
def checksum_memory(tmp_path_factory):
    """Remembered file hashes go to a scratch folder, not the user's cache."""
    import os

    os.environ["SPECRT_CACHE_DIR"] = str(tmp_path_factory.mktemp("specrt-cache"))


def drafts_keep_the_targets_output(generator, prompt: list[int]) -> None:
    """The model drafting K = 3 every round gives the target alone's output, greedy and
    seeded, and some of its drafts are kept (what a draft with a reduced vocabulary must
    still do)."""
    from specrt.runtime import GenerationConfig

    settings = dict(max_new_tokens=32, ignore_eos=True, proposer="model", draft_schedule="fixed")
    for config in (settings, dict(settings, temperature=1.0, seed=3)):
        alone = generator.generate([prompt], GenerationConfig(num_draft_tokens=0, **config))[0]
        drafted = generator.generate([prompt], GenerationConfig(num_draft_tokens=3, **config))[0]
        assert drafted.token_ids == alone.token_ids
        assert drafted.stats.accepted_tokens > 0


def in_threads(work, items, timeout: float = 120) -> dict:
    """Run ``work(item)`` for every item at once, one thread each; their results by item. A
    thread's exception is raised here."""
    import threading

    results, errors = {}, []

    def run(item) -> None:
        try:
            results[item] = work(item)
        except Exception as exc:  # noqa: BLE001 - raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(item,)) for item in items]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    if errors:
        raise errors[0]
    return results


# The CUDA engines ------------------------------------------------------------------------------
@pytest.fixture(
    scope="session",
    params=[
        ("llama", "batched"),
        ("gpt2", "batched"),
        ("llama", "group_query"),
        ("llama", "batched_lengths"),
    ],
)
def cuda_bundle(request, tmp_path_factory):
    """The cuda engines of a tiny pair: the batched graph (the default), or the one-row
    GroupQueryAttention graph (what Gemma 2 gets; `cuda_attention` to compare them on a GPU)."""
    arch, attention = request.param
    root = tmp_path_factory.mktemp(f"cuda-{arch}-{attention}")
    target, draft = make_tiny_pair(arch, root / "src", seed=3, draft_noise=0.3)
    export_bundle(target, draft, root / "bundle", devices=("cpu", "cuda"), cuda_attention=attention)
    return root / "bundle"


@pytest.fixture
def batched_bundle(cuda_bundle):
    if not batched(cuda_bundle):
        pytest.skip("a one-row cuda engine (GroupQueryAttention)")
    return cuda_bundle


@pytest.fixture
def cuda_rule(monkeypatch):
    """Sessions asked for on CUDA bind as CUDA's do (`tests/cuda_rule.py`)."""
    with cuda_on_cpu(monkeypatch):
        yield


@pytest.fixture
def small_steps(monkeypatch):
    """The cache grows 16 positions at a time (not 256): the tiny models' rows grow it often."""
    from specrt.backends import device_rows, rows

    monkeypatch.setattr(rows, "CAPACITY_STEP", 16)
    monkeypatch.setattr(device_rows, "DEVICE_CAPACITY_STEP", 16)


def log_softmax_after(target, tokens: list[int], count: int) -> np.ndarray:
    """The target's log-softmax ``[count, V]`` (float64) at the last ``count`` positions of
    one plain pass over ``tokens`` from an empty row 0: the reference for log-probabilities."""
    target.set_length(0, 0)
    logits = target.forward(tokens, keep_last=count).logits
    logits = np.asarray(logits, np.float64).reshape(count, -1)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

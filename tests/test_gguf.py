"""GGUF checkpoints in: a tiny Llama pair written as GGUF files here (no download) exports to the
bundle its Hugging Face checkpoints would, names the GGUF files as its sources, and rebuilds
from them."""

from __future__ import annotations

import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM

from specrt.bundle import read_manifest
from specrt.chat import ChatTemplate
from specrt.checksums import sha256_file
from specrt.cli import main
from specrt.export.build import build_engines
from specrt.export.tiny import make_tiny_pair
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from tests.gguf_writer import write_llama_gguf

TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}{% endfor %}"


def test_a_gguf_pair_exports_the_models_it_holds(tmp_path):
    target, draft = make_tiny_pair("llama", tmp_path / "hf", seed=3)
    target_gguf = write_llama_gguf(target, tmp_path / "target.gguf", chat_template=TEMPLATE)
    (tmp_path / "draft").mkdir()
    write_llama_gguf(draft, tmp_path / "draft" / "tiny-draft.Q8_0.gguf")  # a folder holding one

    runner = CliRunner()
    bundle = tmp_path / "bundle"
    args = ["export", "--target", str(target_gguf), "--draft", str(tmp_path / "draft")]
    result = runner.invoke(main, [*args, "--out", str(bundle)])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(bundle)
    spec = manifest.models["target"]
    assert spec.source == str(target_gguf.resolve())
    assert spec.source_sha256 == sha256_file(target_gguf)
    assert manifest.models["draft"].source.endswith("tiny-draft.Q8_0.gguf")
    assert not list(tmp_path.glob(".bundle.gguf-*"))  # the converted folders are gone
    template = ChatTemplate.from_directory(bundle / "tokenizer")  # the GGUF's, carried over
    assert template is not None and template.render([{"role": "user", "content": "Hi"}]) == "<s>Hi"

    # The bundle's target is the model the GGUF holds: greedy, its tokens are PyTorch's.
    prompt = [1, 5, 9, 12, 20, 7, 30]
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24
        )[0, len(prompt) :].tolist()
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    config = dict(max_new_tokens=24, ignore_eos=True)
    alone = generator.generate([prompt], GenerationConfig(num_draft_tokens=0, **config))[0]
    spec_out = generator.generate([prompt], GenerationConfig(num_draft_tokens=3, **config))[0]
    assert alone.token_ids == expected
    assert spec_out.token_ids == expected

    # `specrt build` finds the GGUF again, and refuses one that changed.
    build_engines(bundle)
    with open(target_gguf, "ab") as file:
        file.write(b"\0" * 32)
    result = runner.invoke(main, ["build", "--bundle", str(bundle)])
    assert result.exit_code == 1 and "changed since this bundle was exported" in result.output


def test_a_folder_of_several_gguf_files_asks_which(tmp_path):
    target, draft = make_tiny_pair("llama", tmp_path / "hf", seed=3)
    folder = tmp_path / "ggufs"
    folder.mkdir()
    for name in ("model.Q4_1.gguf", "model.Q8_0.gguf"):
        write_llama_gguf(target, folder / name)
    args = ["export", "--target", str(folder), "--draft", str(draft)]
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "bundle")])
    assert result.exit_code == 1
    assert "holds 2 GGUF files (model.Q4_1.gguf, model.Q8_0.gguf); pass the one" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "bundle").exists()


def test_a_gguf_whose_tokenizer_cannot_be_read_is_one_line(tmp_path):
    """A Qwen2 GGUF with a byte-pair tokenizer but no merges (the tiny tokenizer has none):
    transformers' converter stops on an AttributeError, which was a traceback."""
    target, draft = make_tiny_pair("qwen2", tmp_path / "hf", seed=3)
    target_gguf = write_llama_gguf(target, tmp_path / "target.gguf", arch="qwen2")
    args = ["export", "--target", str(target_gguf), "--draft", str(draft)]
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "bundle")])
    assert result.exit_code == 1
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(f"Error: target GGUF file '{target_gguf}' cannot be read"), line
    assert "Traceback" not in result.output and not (tmp_path / "bundle").exists()


def test_a_gguf_file_cut_short_is_named_as_such(tmp_path):
    """A copy cut short (an interrupted download) reached transformers' reader, whose error
    said only "cannot reshape array"."""
    target, draft = make_tiny_pair("llama", tmp_path / "hf", seed=3)
    whole = write_llama_gguf(target, tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "target.gguf"
    cut.write_bytes(whole[: len(whole) - 1000])
    args = ["export", "--target", str(cut), "--draft", str(draft)]
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "bundle")])
    assert result.exit_code == 1
    line = result.output.strip().splitlines()[-1]
    assert line.startswith(f"Error: target GGUF file '{cut}' is truncated or damaged"), line
    assert line.endswith("copy or download it again"), line
    assert "Traceback" not in result.output and not (tmp_path / "bundle").exists()

"""The CLI's happy paths: export from a recipe, generate with JSON and human output."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from specrt.bundle import read_manifest
from specrt.cli import DEFAULTS as CLI_DEFAULTS
from specrt.cli import main
from specrt.export.tiny import make_tiny_pair
from tests.conftest import chat_bundle

STATS_KEYS = {
    "prompt_tokens",
    "cached_tokens",
    "new_tokens",
    "rounds",
    "draft_rounds",
    "drafted_tokens",
    "accepted_tokens",
    "acceptance_rate",
    "mean_accepted_tokens",
    "tokens_per_round",
    "accepted_per_position",
    "wall_time_s",
    "tokens_per_second",
    "draft_stopped",
    "proposers",
}


def test_export_recipe_then_generate_json(tmp_path):
    recipe = tmp_path / "pair.json"
    recipe.write_text(json.dumps({"tiny": {"arch": "gpt2", "seed": 3}}))
    runner = CliRunner()
    result = runner.invoke(main, ["export", "--recipe", str(recipe)])
    assert result.exit_code == 0, result.output
    bundle = tmp_path / "pair"
    assert read_manifest(bundle).models["target"].model_type == "gpt2"

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n    return"}) + "\n" + '"Flat is"\n')
    args = ["generate", "--bundle", str(bundle), "--prompt-file", str(prompts), "--json"]
    result = runner.invoke(main, [*args, "--max-new-tokens", "12", "--num-draft-tokens", "3"])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.output.splitlines()]
    assert len(records) == 2
    for record in records:
        assert set(record) == {"text", "token_ids", "finish_reason", "stats"}
        assert set(record["stats"]) == STATS_KEYS
        assert record["finish_reason"] in ("stop", "length")
        assert 1 <= len(record["token_ids"]) <= 12
        assert len(record["stats"]["accepted_per_position"]) == 3


def test_generate_human_output_with_comparison(llama_bundle):
    # A fixed schedule: the adaptive one may measure that drafting does not pay and draft
    # nothing, and then no acceptance is printed (timing-dependent: it failed a CI run).
    args = ["generate", "--bundle", str(llama_bundle), "--prompt", "Simple is", "--compare"]
    args += ["--draft-schedule", "fixed"]
    result = CliRunner().invoke(main, [*args, "--max-new-tokens", "8", "--ignore-eos"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Simple is")
    assert "acceptance" in result.output and "identical output" in result.output
    assert "vs target alone" in result.output


def test_a_reader_that_stops_early_stops_the_command_quietly(llama_bundle, tmp_path):
    """`specrt generate ... | head`: once the reader is gone the command stops with status 1,
    and prints nothing (no "Broken pipe", no traceback), as Unix tools do."""
    import subprocess
    import sys

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"def f{i}(x):\n" for i in range(400)))
    command = [sys.executable, "-m", "specrt.cli", "generate", "--bundle", str(llama_bundle)]
    command += ["--prompt-file", str(prompts), "--json", "--max-new-tokens", "8"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.read(10)  # the first result came, then the reader goes away
    process.stdout.close()
    _, errors = process.communicate(timeout=300)
    assert process.returncode == 1
    assert errors.decode().strip() == ""


@pytest.mark.parametrize(
    ("module", "raised"),
    [
        ("specrt.cli", "KeyboardInterrupt"),
        # onnxruntime's extension, interrupted while it starts, says "initialization failed"
        ("onnxruntime", "ImportError('initialization failed') from KeyboardInterrupt()"),
        ("onnxruntime", "ImportError('a broken install')"),  # not an interrupt: left as it is
    ],
)
def test_ctrl_c_while_the_command_line_loads_is_one_line(module, raised):
    """Ctrl-C in the second or two `specrt` spends importing numpy and onnxruntime ended in a
    traceback. The interrupt is raised where the import would run (a real signal could land
    before Python handles it, or after the imports)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "class Interrupted:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {module!r}:\n"
        f"            raise {raised}\n"
        "sys.meta_path.insert(0, Interrupted())\n"
        "from specrt.__main__ import main\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if "broken" in raised:
        assert done.returncode == 1 and "ImportError: a broken install" in done.stderr
        return
    assert done.returncode == 130 and done.stderr.strip() == "interrupted (Ctrl-C)", done.stderr


def test_runtime_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import sys, specrt.runtime, specrt.cli; "
        "bad = [m for m in ('torch', 'transformers', 'optimum') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_export_and_build_without_the_export_extra_say_what_to_install(llama_bundle, tmp_path):
    """A runtime-only install (no transformers) got a traceback from deep in the exporter."""
    import subprocess
    import sys

    code = "import sys; sys.modules['transformers'] = None; from specrt.cli import main; main()"
    commands = [
        ["export", "--target", "t", "--draft", "d", "--out", str(tmp_path / "b")],
        ["build", "--bundle", str(llama_bundle)],
    ]
    for args in commands:
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines() == [
            f"Error: specrt {args[0]} needs the export extra (transformers missing): pip install"
            " torch==2.13.0 && pip install 'specrt[export]'"
        ]
    assert not (tmp_path / "b").exists()


def test_export_without_the_portable_graph_needs_no_optimum(tmp_path):
    """`--no-portable` (and `build`) write no portable graph, which is all optimum is for; the
    export extra's check asked for it anyway. The portable export still names it."""
    import subprocess
    import sys

    recipe = tmp_path / "pair.json"
    recipe.write_text(json.dumps({"tiny": {"arch": "llama", "seed": 3}}))
    code = "import sys; sys.modules['optimum'] = None; from specrt.cli import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", code, "export", "--recipe", str(recipe), "--no-portable"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "pair" / "target" / "model.onnx").exists()  # no portable graph
    done = subprocess.run(
        [sys.executable, "-c", code, "export", "--recipe", str(recipe), "--force"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "Error: specrt export needs the export extra (optimum missing): pip install"
        " torch==2.13.0 && pip install 'specrt[export]'"
    ]


def test_export_engine_options(tmp_path):
    """--draft-precision float32 keeps the draft engine exact; --no-ort-engine builds none;
    an unknown precision is refused by the CLI before any work."""
    recipe = tmp_path / "pair.json"
    recipe.write_text(json.dumps({"tiny": {"arch": "qwen2", "seed": 4}, "draft_precision": "int4"}))
    runner = CliRunner()
    result = runner.invoke(
        main, ["export", "--recipe", str(recipe), "--draft-precision", "float32"]
    )
    assert result.exit_code == 0, result.output
    engine = read_manifest(tmp_path / "pair").models["draft"].engines["onnxruntime"]
    assert engine.precision == "float32" and engine.export_check["max_abs_logit_diff"] < 1e-4

    result = runner.invoke(main, ["export", "--recipe", str(recipe), "--force"])
    assert result.exit_code == 0, result.output  # the recipe's own choice: int4
    assert read_manifest(tmp_path / "pair").models["draft"].engines["onnxruntime"].precision == (
        "int4"
    )
    result = runner.invoke(main, ["export", "--recipe", str(recipe), "--no-ort-engine", "--force"])
    assert result.exit_code == 0, result.output
    assert all(not spec.engines for spec in read_manifest(tmp_path / "pair").models.values())

    result = runner.invoke(main, ["export", "--recipe", str(recipe), "--draft-precision", "fp8"])
    assert result.exit_code == 2 and "fp8" in result.output


def test_build_engines_for_an_existing_bundle(tmp_path):
    """`specrt build` adds the onnxruntime engines to a bundle exported without them, from the
    checkpoints it was exported from; without those checkpoints it fails and changes nothing."""
    recipe = tmp_path / "pair.json"
    recipe.write_text(json.dumps({"tiny": {"arch": "llama", "seed": 6}, "ort_engine": False}))
    runner = CliRunner()
    assert runner.invoke(main, ["export", "--recipe", str(recipe)]).exit_code == 0
    bundle = tmp_path / "pair"
    assert all(not spec.engines for spec in read_manifest(bundle).models.values())

    result = runner.invoke(main, ["build", "--bundle", str(bundle), "--draft-precision", "int4"])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(bundle)
    assert manifest.models["target"].engines["onnxruntime"].precision == "float32"
    assert manifest.models["draft"].engines["onnxruntime"].precision == "int4"
    args = ["generate", "--bundle", str(bundle), "--prompt", "Simple is", "--json"]
    outputs = {}
    for engine in ("portable", "onnxruntime"):
        result = runner.invoke(main, [*args, "--engine", engine, "--num-draft-tokens", "0"])
        assert result.exit_code == 0, result.output
        outputs[engine] = json.loads(result.output)["token_ids"]
    assert outputs["portable"] == outputs["onnxruntime"]
    for flags, cache in ((["--cuda-attention", "group_query"], "in_place"), ([], "batched")):
        result = runner.invoke(main, ["build", "--bundle", str(bundle), "--device", "cuda", *flags])
        assert result.exit_code == 0, result.output
        assert read_manifest(bundle).models["target"].engines["cuda"].cache == cache

    before = (bundle / "manifest.json").read_text()
    make_tiny_pair("llama", tmp_path / ".pair.sources", seed=7)  # other weights, same place
    result = runner.invoke(main, ["build", "--bundle", str(bundle)])
    changed = "changed since this bundle was exported from it"
    assert result.exit_code == 1 and changed in result.output and "atol" not in result.output
    # a bundle from before checkpoints were hashed: the numeric check says the same
    data = json.loads(before)
    for spec in data["models"].values():
        spec["source_sha256"] = ""
    (bundle / "manifest.json").write_text(json.dumps(data))
    result = runner.invoke(main, ["build", "--bundle", str(bundle)])
    assert result.exit_code == 1 and changed in result.output and "atol" not in result.output
    (bundle / "manifest.json").write_text(before)
    shutil.rmtree(tmp_path / ".pair.sources" / "draft")
    result = runner.invoke(main, ["build", "--bundle", str(bundle)])
    assert result.exit_code == 1 and "is gone" in result.output
    assert (bundle / "manifest.json").read_text() == before


def test_build_compares_what_a_config_says_not_its_layout(tmp_path):
    """A source config.json only re-indented (or saved by another transformers) is the same
    model: build went on to say it "is no longer the model in the bundle". A value changed is
    still told; a bundle of an earlier version (its config's bytes hashed) still builds."""
    from specrt.export import export_bundle
    from specrt.export.checkpoint_hash import checkpoint_hashes

    target, draft = make_tiny_pair("llama", tmp_path / "src", seed=8)
    bundle = tmp_path / "bundle"
    export_bundle(target, draft, bundle, ort_engine=False)
    config_path = target / "config.json"
    config = json.loads(config_path.read_text())
    config["transformers_version"] = "9.9.9"
    config_path.write_text(json.dumps(config, indent=7, sort_keys=True) + "\n\n")
    build = ["build", "--bundle", str(bundle), "--draft-precision", "float32"]
    result = CliRunner().invoke(main, build)
    assert result.exit_code == 0, result.output
    assert read_manifest(bundle).models["target"].engines

    data = json.loads((bundle / "manifest.json").read_text())  # as an earlier version wrote it
    data["models"]["target"]["source_sha256"] = checkpoint_hashes(target)[1]
    (bundle / "manifest.json").write_text(json.dumps(data))
    assert CliRunner().invoke(main, build).exit_code == 0

    config["eos_token_id"] = 3  # what the model is: changed
    config_path.write_text(json.dumps(config))
    result = CliRunner().invoke(main, build)
    assert result.exit_code == 1 and "changed since this bundle was exported" in result.output


def test_proposers_from_the_command_line(llama_bundle, tmp_path):
    """The default (hybrid), prompt lookup and the model give the target's greedy output, with
    stats per proposer; `specrt batch --suffix-cache` reports the cache; bad n-gram sizes are
    one clear line."""
    runner = CliRunner()
    prompt = "a b c a b c a b c a b"
    base = ["generate", "--bundle", str(llama_bundle), "--prompt", prompt, "--json"]
    base += ["--max-new-tokens", "24", "--ignore-eos"]

    def record(*extra):
        result = runner.invoke(main, [*base, *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    alone = record("--num-draft-tokens", "0")
    default = record()
    lookup = record("--proposer", "lookup", "--prompt-lookup-min", "2")
    model = record("--proposer", "model")
    assert alone["token_ids"] == default["token_ids"] == lookup["token_ids"] == model["token_ids"]
    assert set(lookup["stats"]["proposers"]) == {"lookup"}
    assert set(model["stats"]["proposers"]) == {"model"}
    # Which the hybrid picks depends on measured times; that it is the default does not.
    assert set(default["stats"]["proposers"]) <= {"model", "lookup"}
    assert CLI_DEFAULTS["proposer"] == "hybrid" and CLI_DEFAULTS["draft_schedule"] == "adaptive"

    bad = runner.invoke(main, [*base, "--prompt-lookup-min", "3", "--prompt-lookup-max", "2"])
    assert bad.exit_code != 0 and "Traceback" not in bad.output
    assert "--prompt-lookup-max 2 is out of range" in bad.output
    # only the minimum given: the message says to raise the maximum with it
    bad = runner.invoke(main, [*base, "--prompt-lookup-min", "5"])
    assert bad.exit_code == 2 and "raise prompt_lookup_max with it" in bad.output

    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": prompt}) + "\n" for i in range(6)))
    for flag, kept in (("--no-suffix-cache", False), ("--suffix-cache", True)):
        summary = tmp_path / f"summary{kept}.json"
        out = tmp_path / f"out{kept}.jsonl"
        args = ["batch", "--bundle", str(llama_bundle), "--input", str(rows), "--output", str(out)]
        result = runner.invoke(main, [*args, "--summary", str(summary), flag, "--ignore-eos"])
        assert result.exit_code == 0, result.output
        report = json.loads(summary.read_text())
        assert (report["suffix_cache_tokens"] > 0) == kept
        assert sum(e["proposed"] for e in report["proposers"].values()) == report["drafted_tokens"]
        texts = {json.loads(line)["text"] for line in out.read_text().splitlines()}
        assert len(texts) == 1  # the same prompt, the same greedy output, cache or not


def test_engine_options_that_would_be_ignored_are_refused(llama_bundle):
    """--cuda-attention without --device cuda, and engine options beside --tensorrt, did nothing
    and said nothing."""
    runner = CliRunner()
    result = runner.invoke(
        main, ["build", "--bundle", str(llama_bundle), "--cuda-attention", "group_query"]
    )
    # a usage error, as click's own (it exited 1), and so is a bad --atol
    assert result.exit_code == 2 and "shapes the cuda engines: add --device cuda" in result.output
    result = runner.invoke(main, ["build", "--bundle", str(llama_bundle), "--atol", "-1"])
    assert result.exit_code == 2 and "--atol -1.0 must be > 0" in result.output  # its words
    args = ["build", "--bundle", str(llama_bundle), "--tensorrt", "--device", "cuda"]
    result = runner.invoke(main, args)
    assert (
        result.exit_code == 2 and "--tensorrt builds plans of the portable graphs" in result.output
    )


def test_generate_renders_chats_with_the_bundles_template(llama_bundle, tmp_path):
    """--chat: a --prompt is a user's message and a messages line a conversation, rendered with
    the bundle's chat template and fed without added special tokens, as the server's chat route
    does; a bundle without a template, or messages without --chat, say so in one line."""
    from specrt.runtime import GenerationConfig, SpeculativeGenerator

    bundle = chat_bundle(llama_bundle, tmp_path)
    chats = tmp_path / "chats.jsonl"
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]
    chats.write_text(json.dumps({"messages": conversation}) + "\n")
    options = ["--max-new-tokens", "6", "--ignore-eos", "--json"]
    args = ["generate", "--bundle", str(bundle), "--chat", "--prompt", "def f", *options]
    result = CliRunner().invoke(main, [*args, "--prompt-file", str(chats)])
    assert result.exit_code == 0, result.output
    got = [json.loads(line)["token_ids"] for line in result.output.splitlines()]
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    rendered = ["<user>def f\n<assistant>", "<system>be brief\n<user>x\n<assistant>"]
    ids = [generator.tokenizer.encode(text, add_special_tokens=False) for text in rendered]
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    assert got == [r.token_ids for r in generator.generate(ids, config)]

    plain = CliRunner().invoke(main, ["generate", "--bundle", str(bundle), "--prompt-file",
                                      str(chats), *options])  # fmt: skip
    assert plain.exit_code == 2 and "holds chat messages: add --chat" in plain.output
    bare = CliRunner().invoke(main, ["generate", "--bundle", str(llama_bundle), "--chat",
                                     "--prompt", "hi", *options])  # fmt: skip
    assert bare.exit_code == 2 and "has no chat template" in bare.output


def test_the_library_and_every_command_draft_alike_by_default():
    """One set of defaults: `GenerationConfig()` and every command's options (generate, batch,
    and serve, whose options are the server's base config) propose, schedule and draft
    alike."""
    from dataclasses import fields

    from specrt.runtime import GenerationConfig

    library = GenerationConfig()
    assert (library.proposer, library.draft_schedule, library.num_draft_tokens) == (
        "hybrid",
        "adaptive",
        4,
    )
    names = {"proposer", "draft_schedule", "num_draft_tokens"}
    for command in ("generate", "batch", "serve"):
        options = {p.name: p.default for p in main.commands[command].params}
        for name in names:
            assert options[name] == getattr(library, name), (command, name)
    assert CLI_DEFAULTS == {f.name: getattr(library, f.name) for f in fields(GenerationConfig)}

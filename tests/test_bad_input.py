"""Bad input gets a clear message and a non-zero exit; nothing already done is lost."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specrt.cli import main
from specrt.errors import BundleError, InvalidInputError
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.batching import Request

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture
def bundle_copy(llama_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(llama_bundle, copy)
    return copy


def generate(bundle, *args):
    return cli("generate", "--bundle", bundle, "--max-new-tokens", 4, *args)


def test_missing_bundle(tmp_path):
    result = generate(tmp_path / "nope", "--prompt", "x")
    assert result.exit_code == 1
    assert "does not exist" in result.output and "specrt export" in result.output
    with pytest.raises(BundleError, match="holds a NUL character"):  # Python's ValueError
        SpeculativeGenerator.from_bundle(f"{tmp_path}/no\0pe")


def test_run_takes_an_iterable_of_requests_said_at_the_call(llama_bundle):
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    one = Request("a", [1, 2, 3], GenerationConfig(max_new_tokens=2))
    for given, name in ((one, "Request"), (None, "NoneType"), (5, "int")):
        with pytest.raises(InvalidInputError, match=f"iterable of Requests .*not {name}"):
            generator.run(given)  # not once iterated: TypeError from deep inside
    assert [key for key, _ in generator.run([one])] == ["a"]


def test_run_refuses_a_key_met_twice_or_unhashable(llama_bundle):
    # results are told apart by key alone: two "a" rows could not be matched to their prompts
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    config = GenerationConfig(max_new_tokens=2)
    twice = [Request("a", [1, 2, 3], config), Request("a", [4, 5], config)]
    with pytest.raises(InvalidInputError, match="request key 'a' appears twice"):
        list(generator.run(twice))
    with pytest.raises(InvalidInputError, match=r"request key \['x'\] is not hashable"):
        list(generator.run([Request(["x"], [1, 2, 3], config)]))
    # the generator is free again, and a key may come back in a later run
    assert [key for key, _ in generator.run(twice[:1])] == ["a"]


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda b: (b / "manifest.json").unlink(), "has no manifest.json"),
        (lambda b: (b / "manifest.json").write_text('{"models": '), "not valid JSON"),
        (lambda b: (b / "target" / "model.onnx").unlink(), "'target/model.onnx' named in"),
        (lambda b: (b / "tokenizer" / "tokenizer.json").unlink(), "tokenizer file"),
        (
            lambda b: (b / "draft" / "model.onnx").write_bytes(b"not onnx"),
            "draft: draft/model.onnx does not match its sha256",
        ),
    ],
    ids=["no-manifest", "truncated-manifest", "missing-graph", "missing-tokenizer", "corrupted"],
)
def test_broken_bundle(bundle_copy, breakage, message):
    breakage(bundle_copy)
    result = generate(bundle_copy, "--prompt", "Simple")
    assert result.exit_code == 1, result.output
    assert message in result.output
    assert "re-export" in result.output


def edit_manifest(bundle, edit):
    path = bundle / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_mismatched_pair_refused_at_load(bundle_copy):
    edit_manifest(bundle_copy, lambda m: m["models"]["draft"].update(tokenizer_hash="0" * 64))
    result = generate(bundle_copy, "--prompt", "Simple")
    assert result.exit_code == 1
    assert "draft and target were exported with different tokenizers" in result.output


def test_schema_version_and_malformed_manifest(bundle_copy):
    edit_manifest(bundle_copy, lambda m: m.update(schema_version=99))
    assert "schema_version 99" in generate(bundle_copy, "--prompt", "a").output
    edit_manifest(bundle_copy, lambda m: m.update(schema_version=1) or m.pop("tokenizer"))
    result = generate(bundle_copy, "--prompt", "a")
    assert result.exit_code == 1 and "manifest.json is malformed" in result.output


@pytest.mark.parametrize("engine", ["portable", "onnxruntime"])
def test_graph_that_does_not_match_manifest(bundle_copy, engine):
    """Valid checksums but the manifest names cache inputs the graph does not have."""

    def edit(manifest):
        target = manifest["models"]["target"]
        io = target["io"] if engine == "portable" else target["engines"][engine]["io"]
        io.update(past_keys=["past.0.k", "past.1.k"])

    edit_manifest(bundle_copy, edit)
    result = generate(bundle_copy, "--prompt", "a", "--engine", engine)
    assert result.exit_code == 1 and "lacks ['past.0.k'" in result.output


@pytest.mark.parametrize("engine", ["portable", "onnxruntime"])
def test_a_manifest_dtype_the_graph_does_not_have_is_refused_at_load(bundle_copy, engine):
    """A manifest saying float16 over a float32 graph ended in onnxruntime's InvalidArgument
    traceback on the first call; now the load refuses it, naming the graph and both dtypes."""

    def edit(manifest):
        target = manifest["models"]["target"]
        (target if engine == "portable" else target["engines"][engine])["dtype"] = "float16"

    edit_manifest(bundle_copy, edit)
    result = generate(bundle_copy, "--prompt", "a", "--engine", engine)
    graph = "target/model.onnx" if engine == "portable" else "target/onnxruntime/model.onnx"
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # not escaped
    assert f"target: the manifest says {graph} is float16" in result.output
    assert "KV cache (past_key_values.0.key) is float32" in result.output
    assert "re-export the bundle" in result.output and "Traceback" not in result.output


def test_engine_from_an_earlier_specrt_asks_for_a_rebuild(bundle_copy):
    """In-place engines once took an attention mask, and batched ones need their position
    inputs; such manifest entries are refused with the fix."""

    def edit(manifest):
        engine = manifest["models"]["target"]["engines"]["onnxruntime"]
        engine["cache"] = "in_place"
        engine["io"].update(attention_mask="attention_mask", seqlens_k=None, total_length=None)
        draft = manifest["models"]["draft"]["engines"]["onnxruntime"]
        draft["io"].update(cache_indices=None)

    edit_manifest(bundle_copy, edit)
    result = generate(bundle_copy, "--prompt", "a")
    # The command to run, with this bundle's path in it (it said "--bundle DIR")
    assert result.exit_code == 1 and f"specrt build --bundle {bundle_copy}`" in result.output
    assert generate(bundle_copy, "--prompt", "a", "--engine", "portable").exit_code == 0


def test_unknown_or_missing_engine(bundle_copy):
    result = generate(bundle_copy, "--prompt", "a", "--engine", "vulkan")
    assert result.exit_code == 2 and "vulkan" in result.output
    edit_manifest(bundle_copy, lambda m: m["models"]["draft"].update(engines={}))
    result = generate(bundle_copy, "--prompt", "a", "--engine", "onnxruntime")
    assert result.exit_code == 1 and "draft has no onnxruntime engine" in result.output
    assert generate(bundle_copy, "--prompt", "a").exit_code == 0  # auto: draft runs portable


def test_empty_prompt(llama_bundle):
    result = generate(llama_bundle, "--prompt", "")
    assert result.exit_code == 1 and "the prompt is empty" in result.output
    # whitespace is text (a newline or an indent, for code): it was refused as "empty"
    result = generate(llama_bundle, "--prompt", "   \n", "--json")
    assert result.exit_code == 0 and len(json.loads(result.output)["token_ids"]) == 4


def test_no_prompt_and_empty_prompt_file(llama_bundle, tmp_path):
    assert generate(llama_bundle).exit_code == 2
    (tmp_path / "empty.txt").write_text("\n\n")
    result = generate(llama_bundle, "--prompt-file", tmp_path / "empty.txt")
    assert result.exit_code == 2 and "empty.txt holds no prompts" in result.output
    result = generate(llama_bundle, "--prompt-file", tmp_path / "missing.txt")
    assert result.exit_code == 2 and "does not exist" in result.output
    result = CliRunner().invoke(  # (it said "prompt file - holds no prompts")
        main, ["generate", "--bundle", str(llama_bundle), "--prompt-file", "-"], input="\n"
    )
    assert result.exit_code == 2 and "Error: standard input holds no prompts" in result.output


def test_per_row_settings_in_a_prompt_file_are_refused_not_ignored(llama_bundle, tmp_path):
    """`specrt generate` reads prompts from a JSONL file; a line that also sets
    max_new_tokens would otherwise get the command's setting without a word."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a", "file": "x.py"}\n{"prompt": "b", "max_new_tokens": 2}\n')
    result = generate(llama_bundle, "--prompt-file", path)
    assert result.exit_code == 2 and "rows.jsonl:2 sets max_new_tokens" in result.output
    assert "specrt batch" in result.output


def test_threads_beyond_the_machine_are_refused(llama_bundle):
    result = generate(llama_bundle, "--prompt", "a", "--threads", "100000")
    assert result.exit_code == 2 and "100000 is far more than this machine's" in result.output
    cpus = os.cpu_count()  # the most it takes, as it says (it said "at most" the CPUs)
    assert f"give at most {4 * cpus} ({cpus}, one a CPU, is usually fastest)" in result.output
    assert generate(llama_bundle, "--prompt", "a", "--threads", 4 * cpus).exit_code == 0
    assert generate(llama_bundle, "--prompt", "a", "--threads", 4 * cpus + 1).exit_code == 2


def test_options_that_change_nothing_are_named(llama_bundle):
    """Sampling options under greedy decoding, and prompt lookup's sizes without prompt
    lookup, were accepted and ignored in silence."""
    result = generate(llama_bundle, "--prompt", "a", "--top-k", "5", "--seed", "3")
    assert result.exit_code == 0
    assert "note: --top-k, --seed change nothing at --temperature 0 (greedy)" in result.output
    result = generate(llama_bundle, "--prompt", "a", "--top-k", "5", "--temperature", "1")
    assert result.exit_code == 0 and "note:" not in result.output
    flags = ("--proposer", "model", "--prompt-lookup-max", "2")
    result = generate(llama_bundle, "--prompt", "a", *flags)
    assert "note: --prompt-lookup-max changes nothing without prompt lookup" in result.output
    # and with nothing drafted, no acceptance rate (it printed 0.00)
    result = generate(llama_bundle, "--prompt", "a", "--num-draft-tokens", "0")
    assert result.exit_code == 0 and "acceptance" not in result.output
    drafting = ("--proposer", "model", "--draft-schedule", "fixed")  # adaptive may draft none
    assert "acceptance" in generate(llama_bundle, "--prompt", "a", *drafting).output


@pytest.mark.parametrize("schedule", ["fixed", "heuristic"])
def test_contradicting_draft_schedules_are_refused(llama_bundle, schedule):
    """--adaptive-draft beside another --draft-schedule: one of them was silently dropped."""
    flags = ("--adaptive-draft", "--draft-schedule", schedule)
    result = generate(llama_bundle, "--prompt", "a", *flags)
    assert result.exit_code == 2 and (
        f"--adaptive-draft and --draft-schedule {schedule} contradict each other" in result.output
    )
    assert generate(llama_bundle, "--prompt", "a", "--adaptive-draft").exit_code == 0


def unprivileged() -> list[str]:
    """A command prefix under which file permissions hold (root reads any file: dropped
    capabilities make it a plain user for the command); None where that cannot be done."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root reads files whatever their permissions, and setpriv is missing")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search", "--"]


@pytest.mark.parametrize("name", ["target/onnxruntime/model.onnx.data", "tokenizer/tokenizer.json"])
def test_an_unreadable_bundle_file_says_so(bundle_copy, name):
    """A file the user may not read is a permissions problem, not a broken bundle."""
    (bundle_copy / name).chmod(0)
    cmd = [sys.executable, "-m", "specrt.cli", "generate", "--bundle", str(bundle_copy)]
    cmd += ["--prompt", "a", "--max-new-tokens", "2", "--skip-checksums"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(unprivileged() + cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "(permission denied)" in done.stderr, done.stderr
    assert "re-export" not in done.stderr and "Traceback" not in done.stderr


def test_prompt_longer_than_max_positions_fails_before_any_work(llama_bundle):
    long_prompt = "Simple is better than complex. " * 6  # 188 tokens > 128 positions
    result = generate(llama_bundle, "--prompt", "Simple", "--prompt", long_prompt, "--json")
    assert result.exit_code == 1
    assert "prompt 2 of 2 has 188 tokens; at most 128 positions fit" in result.output
    assert "Shorten it" in result.output
    assert '"text"' not in result.output  # checked up front: no half batch


@pytest.mark.parametrize("engine", ["onnxruntime", "portable"])
def test_max_length_caps_the_sequence(llama_bundle, engine):
    """--max-length bounds the preallocated KV cache (and so prompt + output) below the model's
    max positions: the limit is enforced up front, and generation stops there with 'length'."""
    prompt = "Simple is better than complex. "  # 33 tokens
    result = generate(llama_bundle, "--prompt", prompt, "--max-length", "20", "--engine", engine)
    assert result.exit_code == 1 and "at most 20 positions fit" in result.output
    assert "--max-length" in result.output
    args = ["--prompt", prompt, "--max-length", "40", "--ignore-eos", "--json", "--engine", engine]
    result = cli("generate", "--bundle", llama_bundle, "--max-new-tokens", 30, *args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert record["finish_reason"] == "length"
    assert record["stats"]["prompt_tokens"] + len(record["token_ids"]) == 40
    assert generate(llama_bundle, "--prompt", "a", "--max-length", "1").exit_code == 2


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--temperature", "-1", "--temperature -1.0 is out of range"),
        ("--temperature", "nan", "--temperature nan is out of range"),
        ("--top-p", "0", "--top-p 0.0 is out of range"),
        ("--top-p", "1.5", "--top-p 1.5 is out of range"),
        ("--top-k", "-1", "--top-k -1 is out of range"),
        ("--num-draft-tokens", "-1", "--num-draft-tokens -1 is out of range"),
        ("--num-draft-tokens", "65", "--num-draft-tokens 65 is out of range"),
        ("--max-new-tokens", "0", "--max-new-tokens 0 is out of range"),
        ("--seed", "-3", "--seed -3 is out of range"),
        ("--stop", "", "--stop [''] is not a stop string"),  # as a list, not a Python tuple
    ],
)
def test_out_of_range_parameters(llama_bundle, option, value, message):
    result = cli("generate", "--bundle", llama_bundle, "--prompt", "a", option, value)
    assert result.exit_code == 2 and message in result.output  # a usage error, as click's own


def test_an_unknown_setting_names_the_one_to_use():
    # OpenAI's, vLLM's and transformers' names for our settings, and a typo: each refused at
    # the call, as a TypeError (any unknown keyword's kind) saying what to write
    for given, said in [
        ({"max_tokens": 8}, "no setting 'max_tokens': use max_new_tokens"),
        ({"num_speculative_tokens": 2}, "no setting 'num_speculative_tokens': use num_draft"),
        ({"do_sample": True}, "no setting 'do_sample': use temperature"),
        ({"temprature": 0.5}, "no setting 'temprature': did you mean 'temperature'\\?"),
        ({"beams": 2}, "no setting 'beams': its settings are max_new_tokens, "),
    ]:
        with pytest.raises(TypeError, match=said) as caught:
            GenerationConfig(**given)
        assert isinstance(caught.value, InvalidInputError)
        assert caught.value.field == next(iter(given))
    assert "adaptive_draft" not in str(caught.value)  # deprecated: not offered
    assert GenerationConfig(8, 2).num_draft_tokens == 2  # positional settings as before


def test_non_numeric_parameter(llama_bundle):
    result = cli("generate", "--bundle", llama_bundle, "--prompt", "a", "--temperature", "hot")
    assert result.exit_code == 2 and "'hot' is not a valid float" in result.output


def test_export_usage_errors(tmp_path):
    assert cli("export", "--target", tmp_path).exit_code == 2
    result = cli("export", "--recipe", tmp_path / "missing.json")
    assert result.exit_code == 1 and "recipe" in result.output and "does not exist" in result.output
    (tmp_path / "bad.json").write_text("[1, 2]")
    result = cli("export", "--recipe", tmp_path / "bad.json")
    assert (
        result.exit_code == 1 and 'must be a JSON object with "target" and "draft"' in result.output
    )
    pair = {"target": "t", "draft": "d"}
    for recipe, message in [  # each refused before any model is built or loaded
        ({**pair, "draft_precison": "int4"}, "unknown key(s) ['draft_precison']"),
        ({**pair, "device": "cuda"}, "(did you mean 'devices'?)"),
        ({**pair, "ort_engine": "false"}, "ort_engine='false' must be true or false"),
        ({**pair, "opset": 3}, "opset=3: use an integer >= 14"),
        ({**pair, "opset": 99}, "opset=99: torch's ONNX exporter, which optimum runs, goes up to"),
        ({**pair, "target_block_size": 64}, "target_block_size=64 is for a quantised target"),
        ({**pair, "ort_engine": False, "draft_precision": "int4"}, "ort_engine false builds no"),
        ({**pair, "devices": "cuda", "target_precision": "int4"}, "devices without cpu builds"),
        ({**pair, "devices": 5}, "devices=5"),
        ({**pair, "atol": "0.1"}, "atol='0.1' must be a number > 0"),
        ({"target": 5, "draft": "d"}, '"target" and "draft" must be paths'),
        ({"target": "t", "eagle": 3}, '"target" and "eagle" must be paths'),  # named "draft"
        ({**pair, "eagle": "h"}, 'give "draft" (a draft model) or "eagle"'),  # "unknown key"
        ({"tiny": "llama"}, '"tiny" must be an object with an "arch" name'),
        ({"tiny": {"arch": "llama", "bogus": 1}}, "unknown \"tiny\" key(s) ['bogus']"),
        ({"tiny": {"arch": "llama"}, "slim": "yes"}, "slim='yes' must be true or false"),
    ]:
        (tmp_path / "r.json").write_text(json.dumps(recipe))
        result = cli("export", "--recipe", tmp_path / "r.json")
        assert result.exit_code == 1, (recipe, result.output)
        assert message.replace('\\"', '"') in result.output, (recipe, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit)
    for flags, message in [  # the same on the command line, in its words
        (["--opset", "99"], "--opset 99: torch's ONNX exporter"),
        (["--target-block-size", "64"], "--target-block-size 64 is for a quantised target"),
        (["--draft-precision", "int4", "--no-ort-engine"], "--draft-precision int4 sets the CPU"),
    ]:
        result = cli("export", "--target", "t", "--draft", "d", "--out", tmp_path / "o", *flags)
        assert result.exit_code == 1 and message in result.output, (flags, result.output)
    # a byte-order mark (as some editors save) is read past: the recipe's own mistake is named
    (tmp_path / "r.json").write_bytes(b'\xef\xbb\xbf{"target": "t", "draft": "d", "opset": 3}')
    result = cli("export", "--recipe", tmp_path / "r.json")
    assert result.exit_code == 1 and "opset=3: use an integer" in result.output, result.output
    (tmp_path / "r.json").write_bytes(b'{"target": "caf\xe9"}')
    result = cli("export", "--recipe", tmp_path / "r.json")
    assert result.exit_code == 1 and "not valid JSON in UTF-8" in result.output
    assert not list(tmp_path.glob(".r.sources"))  # no tiny pair built for a bad recipe


def test_engine_on_a_gpu_provider_is_refused_with_the_way_out(llama_bundle):
    from specrt.backends.select import select_graph
    from specrt.bundle import read_manifest

    spec = read_manifest(llama_bundle).models["target"]
    gpu = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    with pytest.raises(InvalidInputError, match="use engine 'cuda', 'portable' or 'auto' on GPU"):
        select_graph(spec, "target", "onnxruntime", gpu)
    assert select_graph(spec, "target", "auto", gpu) is spec  # auto: the portable graph
    # TensorRT compiles the portable graph: a --no-portable bundle's engine graph (contrib
    # ops, a batched cache) failed in its profiles instead
    trt = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    with pytest.raises(InvalidInputError, match="what the TensorRT provider compiles"):
        select_graph(spec.engine_view("onnxruntime"), "target", "auto", trt)
    assert select_graph(spec, "target", "auto", trt) is spec
    # and this CPU build of onnxruntime refuses the GPU provider instead of falling back
    with pytest.raises(InvalidInputError, match="not available in this onnxruntime"):
        SpeculativeGenerator.from_bundle(llama_bundle, providers=gpu, engine="onnxruntime")


def test_a_bench_plot_that_cannot_be_written_is_found_before_the_benchmark(llama_bundle, tmp_path):
    (tmp_path / "file").write_text("mine\n")
    result = cli(
        "bench", "--bundle", llama_bundle, "--prompt", "a", "--plot", tmp_path / "file/p.png"
    )
    assert result.exit_code == 2 and "is a file, not a folder" in result.output
    assert "tokens/s" not in result.output  # nothing ran
    # a format matplotlib cannot write: a traceback after the whole benchmark, before
    result = cli("bench", "--bundle", llama_bundle, "--prompt", "a", "--plot", tmp_path / "p.xyz")
    assert result.exit_code == 1 and "matplotlib writes no .xyz files" in result.output
    assert "tokens/s" not in result.output and ".png" in result.output

"""Whatever a user types and whatever state the machine is in: one clear line and a non-zero
exit, never a traceback, never a silently wrong result."""

from __future__ import annotations

import codecs
import json
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specrt.cli import main
from specrt.errors import InvalidInputError
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from tests.conftest import build_bundle


def cli(*args, **kwargs):
    return CliRunner().invoke(main, [str(a) for a in args], **kwargs)


def one_clear_line(result, exit_code: int = 1) -> str:
    """The CLI failed the way a user's mistake should: the exit code and one line, no
    traceback (CliRunner keeps an escaped exception in result.exception)."""
    assert result.exit_code == exit_code, result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    return result.output


def generate(bundle, *args, **kwargs):
    return cli("generate", "--bundle", bundle, "--max-new-tokens", 4, *args, **kwargs)


# -- prompt files ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, content, message",
    [
        ("latin1.txt", "café\n".encode("latin-1"), "latin1.txt:1 is not UTF-8"),
        ("late.txt", b"ok\nfine\n\xff\xfe\x00oops\n", "late.txt:3 is not UTF-8"),
        ("nokey.jsonl", b'{"text": "x"}\n', 'nokey.jsonl:1 has no "prompt" key'),
        ("number.jsonl", b'{"prompt": "a"}\n{"prompt": 3}\n', "number.jsonl:2: a prompt must"),
        ("null.jsonl", b"null\n", "null.jsonl:1: a prompt must be a JSON string, not null"),
        ("bool.jsonl", b"true\n", "not a boolean"),
        ("object.jsonl", b'{"prompt": {"a": 1}}\n', "not an object"),
        ("list.jsonl", b"[1, 2]\n", "not an array"),
        ("broken.jsonl", b'{"prompt": \n', "broken.jsonl:1 is not JSON"),
        # past Python's recursion and digit limits: RecursionError and ValueError escaped
        ("deep.jsonl", b'{"prompt": ' + b"[" * 100_000 + b"\n", "deep.jsonl:1 is not JSON (nested"),
        ("digits.jsonl", b'{"prompt": "a", "n": ' + b"9" * 5000 + b"}\n", "a number too long"),
        ("bad16.txt", codecs.BOM_UTF16_LE + b"\x00\xd8", "is not valid UTF-16"),
        # read as UTF-8, a prompt of NULs was run
        ("nobom16.txt", "Simple is\n".encode("utf-16-le"), "nobom16.txt:1 holds a NUL byte"),
    ],
)
def test_bad_prompt_files_name_the_file_and_line(llama_bundle, tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    output = one_clear_line(generate(llama_bundle, "--prompt-file", path), exit_code=2)
    assert message in output


@pytest.mark.parametrize(
    "name, content",
    [
        ("bom.txt", codecs.BOM_UTF8 + b"Simple is\n"),
        ("utf16.txt", "Simple is\n".encode("utf-16")),
        ("upper.JSONL", b'{"prompt": "Simple is"}\n'),
        ("plain.txt", b"\n  \nSimple is\n\n"),
    ],
)
def test_prompt_files_in_every_encoding_read_the_same(llama_bundle, tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    expected = generate(llama_bundle, "--prompt", "Simple is", "--json")
    result = generate(llama_bundle, "--prompt-file", path, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["token_ids"] == json.loads(expected.output)["token_ids"]


def test_prompt_files_repeat_and_add_up(llama_bundle, tmp_path):
    """`--prompt-file` twice reads both files, in turn, after the --prompt ones (only the last
    was read, silently; the first, too long to run, was never even checked)."""
    first, second = tmp_path / "first.txt", tmp_path / "second.jsonl"
    first.write_text("Simple is\nNow is\n")
    second.write_text('{"prompt": "def fib"}\n')
    result = generate(llama_bundle, "--prompt", "Sparse is", "--prompt-file", first,
                      "--prompt-file", second, "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    got = [json.loads(line)["token_ids"] for line in result.output.splitlines()]
    alone = [json.loads(generate(llama_bundle, "--prompt", text, "--json").output)["token_ids"]
             for text in ("Sparse is", "Simple is", "Now is", "def fib")]  # fmt: skip
    assert got == alone
    (tmp_path / "empty.txt").write_text("\n")
    output = one_clear_line(
        generate(llama_bundle, "--prompt-file", first, "--prompt-file", tmp_path / "empty.txt"), 2
    )
    assert "empty.txt holds no prompts" in output


def test_prompts_from_stdin_and_a_pipe(llama_bundle, tmp_path):
    expected = json.loads(generate(llama_bundle, "--prompt", "Simple is", "--json").output)
    result = generate(llama_bundle, "--prompt-file", "-", "--json", input="Simple is\n")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["token_ids"] == expected["token_ids"]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("Simple is\n"))
    writer.start()
    result = generate(llama_bundle, "--prompt-file", fifo, "--json")
    writer.join()
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["token_ids"] == expected["token_ids"]
    output = one_clear_line(generate(llama_bundle, "--prompt-file", "/dev/zero"), 2)  # endless
    assert "/dev/zero is a device" in output


def test_prompt_that_is_not_utf8_text(llama_bundle):
    output = one_clear_line(generate(llama_bundle, "--prompt", "caf\udce9"))
    assert "not valid UTF-8" in output


def test_json_past_python_s_limits_in_a_manifest_or_the_checksum_memory(
    llama_bundle, tmp_path, monkeypatch
):
    """A manifest nested past the recursion limit is a bad manifest in one line (generate,
    build); a checksum memory so nested is no memory: files are hashed again."""
    import shutil

    bundle = tmp_path / "deep"
    shutil.copytree(llama_bundle, bundle)
    (bundle / "manifest.json").write_text("[" * 100_000)
    for args in (["generate", "--bundle", bundle, "--prompt", "a"], ["build", "--bundle", bundle]):
        assert "manifest.json is not valid JSON (nested" in one_clear_line(cli(*args))
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (cache / "verified-files.json").write_text("[" * 100_000)
    (cache / "verified-files.json").chmod(0o600)
    monkeypatch.setenv("SPECRT_CACHE_DIR", str(cache))
    assert generate(llama_bundle, "--prompt", "a").exit_code == 0


# -- the machine's state -------------------------------------------------------------------------
@pytest.fixture
def mount(tmp_path):
    """Mount a small tmpfs (root only): real ENOSPC and EROFS, no simulation."""
    mounted = []

    def make(name: str, options: str) -> Path:
        point = tmp_path / name
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")
        mounted.append(point)
        return point

    yield make
    for point in mounted:
        subprocess.run(["umount", str(point)], check=False)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from specrt.export.tiny import make_tiny_pair

    return make_tiny_pair(out_dir=tmp_path_factory.mktemp("src") / "pair", arch="llama")


def test_disk_full_during_export(sources, mount):
    disk = mount("full", "size=256k")
    target, draft = sources
    output = one_clear_line(
        cli("export", "--target", target, "--draft", draft, "--out", disk / "b", "--no-ort-engine")
    )
    assert "No space left on device" in output or "no space" in output.lower(), output
    assert list(disk.iterdir()) == []  # nothing left behind


def test_read_only_file_system(sources, mount, llama_bundle, tmp_path):
    readonly = mount("ro", "ro,size=1m")
    target, draft = sources
    output = one_clear_line(
        cli("export", "--target", target, "--draft", draft, "--out", readonly / "b")
    )
    assert "Read-only file system" in output and "write somewhere else" in output
    output = one_clear_line(generate(llama_bundle, "--prompt-file", readonly / "none.txt"), 2)
    assert "does not exist" in output


def test_batch_on_a_read_only_file_system_says_so(mount, llama_bundle, tmp_path):
    """`specrt batch` said "permission denied" for an --output or --summary on a read-only
    file system (as export and build do not): a new file there, and one there already."""
    disk = mount("ro", "size=1m")
    (disk / "summary.json").write_text("{}")
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"id": "a", "prompt": "a"}\n')
    batch = ["batch", "--bundle", llama_bundle, "--input", rows]
    for args, where in [
        (["--output", disk / "new" / "out.jsonl"], f"cannot write in {disk}"),
        (["--output", tmp_path / "out.jsonl", "--summary", disk / "summary.json"], "cannot be"),
    ]:
        output = one_clear_line(cli(*batch, *args), 2)
        assert where in output and "(read-only file system: write somewhere else)" in output
        assert "permission denied" not in output
    assert (disk / "summary.json").read_text() == "{}" and not (tmp_path / "out.jsonl").exists()


def test_broken_config_json(sources, tmp_path):
    target, draft = sources
    broken = tmp_path / "target"
    shutil.copytree(target, broken)
    (broken / "config.json").write_text('{"model_type": "llama", ')
    output = one_clear_line(
        cli("export", "--target", broken, "--draft", draft, "--out", tmp_path / "b")
    )
    assert "config.json cannot be read" in output
    assert not (tmp_path / "b").exists()


# -- manifests -----------------------------------------------------------------------------------
def edit_manifest(bundle: Path, edit) -> None:
    path = bundle / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def target(data):
    return data["models"]["target"]


def engine(data):
    return target(data)["engines"]["onnxruntime"]


MANIFEST_EDITS = {
    "models-list": (lambda m: m.update(models=[1]), "manifest.models is a list, not an object"),
    "eos-int": (lambda m: m["tokenizer"].update(eos_token_ids=0), "eos_token_ids is an integer"),
    "eos-str": (lambda m: m["tokenizer"].update(eos_token_ids="0"), "eos_token_ids is a string"),
    "eos-range": (lambda m: m["tokenizer"].update(eos_token_ids=[10**6]), "tokenizer.eos_token"),
    "max-pos-neg": (lambda m: target(m).update(max_positions=-5), "max_positions is -5"),
    "max-pos-zero": (lambda m: target(m).update(max_positions=0), "max_positions is 0"),
    "max-pos-str": (lambda m: target(m).update(max_positions="1024"), "max_positions is a str"),
    "max-pos-bool": (lambda m: target(m).update(max_positions=True), "max_positions is a bool"),
    "dtype": (lambda m: target(m).update(dtype="bfloat16"), "dtype is 'bfloat16'"),
    "files-list": (lambda m: target(m).update(files=["a"]), "files is a list, not an object"),
    "files-empty": (lambda m: target(m).update(files={}), "files is {}"),
    "path-unlisted": (lambda m: target(m).update(path="tokenizer/tokenizer.json"), ".path is"),
    "path-escapes": (
        lambda m: target(m)["files"].update({"../../etc/passwd": "0" * 64}),
        "a path inside the bundle",
    ),
    "tok-vocab-str": (lambda m: m["tokenizer"].update(vocab_size="4096"), "vocab_size is a str"),
    "vocab-zero": (lambda m: m.update(vocab_size=0), "manifest.vocab_size is 0"),
    "unknown-field": (lambda m: target(m).update(colour="red"), "unknown field(s) ['colour']"),
    "io-missing": (lambda m: target(m).pop("io"), "manifest.models.target.io is missing"),
    "layers-float": (lambda m: target(m).update(num_layers=2.5), "num_layers is a number"),
    "head-dim-null": (lambda m: target(m).update(head_dim=None), "head_dim is null, not an"),
    "schema-str": (lambda m: m.update(schema_version="1"), 'schema_version "1", not an integer'),
    "cache": (lambda m: target(m).update(cache="paged"), "cache kind 'paged'"),
    "window-neg": (lambda m: engine(m).update(sliding_window=-1), "sliding_window is -1"),
    "io-argmax": (lambda m: engine(m)["io"].update(argmax="x"), "graph lacks ['x']"),
    "io-local-mask": (
        lambda m: engine(m)["io"].update(local_attention_mask="x"),
        "graph lacks ['x']",
    ),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_EDITS))
def test_manifest_fields_are_checked_at_load(llama_bundle, tmp_path, case):
    edit, message = MANIFEST_EDITS[case]
    bundle = tmp_path / "bundle"
    shutil.copytree(llama_bundle, bundle)
    edit_manifest(bundle, edit)
    output = one_clear_line(generate(bundle, "--prompt", "a"))
    assert message in output and "re-export" in output, output


def test_manifest_with_infinity_or_a_newer_schema(llama_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(llama_bundle, bundle)
    text = (bundle / "manifest.json").read_text()
    (bundle / "manifest.json").write_text(text.replace('"atol": 0.001', '"atol": Infinity', 1))
    assert "Infinity is not a JSON value" in one_clear_line(generate(bundle, "--prompt", "a"))
    (bundle / "manifest.json").write_text(
        text.replace('"schema_version": 1', '"schema_version": 7')
    )
    output = one_clear_line(generate(bundle, "--prompt", "a"))
    assert "newer specrt" in output and "upgrade specrt" in output
    assert "Infinity" not in "".join(p.read_text() for p in [llama_bundle / "manifest.json"])


def test_bundle_path_that_is_a_file(llama_bundle):
    output = one_clear_line(generate(llama_bundle / "manifest.json", "--prompt", "a"))
    assert "is a file, not a bundle directory" in output


def test_graph_wider_than_the_manifest_says(llama_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(llama_bundle, bundle)

    def narrower(m):
        engine = target(m)["engines"]["onnxruntime"]
        engine["vocab_size"] -= 1
        m["vocab_size"] -= 1
        m["tokenizer"]["vocab_size"] -= 1
        target(m)["vocab_size"] -= 1
        m["models"]["draft"]["vocab_size"] -= 1
        m["models"]["draft"]["engines"]["onnxruntime"]["vocab_size"] -= 1

    edit_manifest(bundle, narrower)
    output = one_clear_line(generate(bundle, "--prompt", "a", "--engine", "onnxruntime"))
    assert "the graph's logits are" in output and "wide" in output


# -- the Python API ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompts, message",
    [
        (None, "prompts must be a list"),
        ({"prompt": "Simple"}, "prompts must be a list"),
        ("Simple", "prompts must be a list"),
        (b"Simple", "prompts must be a list"),
        ([b"Simple"], "the prompt is bytes"),
        ([[3, 4.5]], "token id 4.5 that is not an integer"),
        ([[True, 4]], "token id True that is not an integer"),
        ([["3"]], "token id '3' that is not an integer"),
        ([[3], None], "prompt 2 of 2 is NoneType"),
        (["a", ""], "prompt 2 of 2 is empty"),  # which of them (it said "the prompt")
        (["a", "\ud800", "b"], "prompt 2 of 3 '.+' is not valid UTF-8"),
        ([{"a": 1}], "the prompt is dict"),
        ([[]], "the prompt is empty"),
        ([[-1]], "outside the vocabulary"),
    ],
)
def test_prompts_of_the_wrong_type(llama_generator, prompts, message):
    with pytest.raises(InvalidInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        llama_generator.generate(prompts, GenerationConfig(max_new_tokens=2))


def test_numpy_token_ids_are_token_ids(llama_generator):
    config = GenerationConfig(max_new_tokens=np.int64(6), num_draft_tokens=np.int32(2))
    as_numpy = llama_generator.generate([np.array([3, 4, 5])], config)
    as_list = llama_generator.generate([[3, 4, 5]], GenerationConfig(6, 2))
    assert as_numpy[0].token_ids == as_list[0].token_ids


@pytest.mark.parametrize(
    "config, message",
    [
        ({"max_new_tokens": 3}, "config must be a GenerationConfig, not dict"),
        ("greedy", "config must be a GenerationConfig, not str"),
    ],
)
def test_config_of_the_wrong_type(llama_generator, config, message):
    with pytest.raises(InvalidInputError, match=message):
        llama_generator.generate(["Simple"], config)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_new_tokens", True),
        ("max_new_tokens", 2.0),
        ("num_draft_tokens", True),
        ("num_draft_tokens", "4"),
        ("temperature", False),
        ("temperature", "0.5"),
        ("temperature", float("inf")),
        ("top_k", 1.5),
        ("top_p", None),
        ("seed", 1.0),
        ("seed", True),
        ("ignore_eos", 1),
        ("adaptive_draft", "yes"),
        ("draft_schedule", None),
    ],
)
def test_generation_config_types(field, value):
    with pytest.raises(InvalidInputError, match=f"{field}="):
        GenerationConfig(**{field: value})


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_new_tokens": "8"}, "max_new_tokens='8' is a string, not an integer"),
        ({"temperature": None}, "temperature=None is null, not a number"),
        ({"max_new_tokens": 0}, "max_new_tokens=0 is out of range: use an integer >= 1"),
        ({"stop": [""]}, "stop=[''] is not a stop string"),
    ],
)
def test_a_wrong_type_is_told_apart_from_a_value_out_of_range(options, message):
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        GenerationConfig(**options)


@pytest.mark.parametrize(
    "field, power, rule",
    [
        ("temperature", 400, "use a finite number >= 0"),
        ("top_p", 400, "use a number in (0, 1]"),
        ("top_p", 5000, "use a number in (0, 1]"),  # beyond what Python prints
        ("num_draft_tokens", 5000, "use an integer in [0, 64]"),
    ],
)
def test_an_integer_beyond_any_float_is_out_of_range(field, power, rule):
    """10**400 as a temperature raised OverflowError (float() of it), not a SpecrtError; the
    message names the value by its length, in one short line."""
    with pytest.raises(InvalidInputError) as raised:
        GenerationConfig(**{field: 10**power})
    message = str(raised.value)
    assert message.startswith(f"{field}=<an integer of {power + 1} digits> is out of range: {rule}")
    assert len(message) < 200 and "\n" not in message


@pytest.mark.parametrize(
    "options, message",
    [
        ({"threads": "2"}, "threads='2' is a string, not an integer"),
        ({"threads": 0}, "threads=0 is out of range"),
        ({"draft_threads": 0}, "draft_threads=0 is out of range"),
        # onnxruntime starts each: 10000 hung the load
        ({"threads": 10_000}, r"threads=10000 is out of range: use 1 to \d+ \(this machine has"),
        ({"draft_threads": 10_000}, "draft_threads=10000 is out of range: use 1 to"),
        ({"providers": "CPUExecutionProvider"}, "give a list of provider names"),
        ({"providers": ["Nope"]}, r"provider\(s\) \['Nope'\] are not available"),
        ({"providers": []}, "give a list of provider names"),
        ({"engine": "vulkan"}, "engine='vulkan'"),
        ({"max_length": 1}, "max_length=1 is out of range"),
        ({"check_files": "no"}, "check_files='no' is a string, not a boolean"),
        ({"max_bach": 4}, r"from_bundle got unknown option\(s\) \['max_bach'\]; it takes"),
        # more rows than memory could hold: the kernel killed the process without a word
        ({"max_batch": 10**9}, r"max_batch=1000000000: that many rows' KV caches grow to"),
    ],
)
def test_load_options_of_the_wrong_type(llama_bundle, options, message):
    with pytest.raises(InvalidInputError, match=message):
        SpeculativeGenerator.from_bundle(llama_bundle, **options)


def test_cli_threads_must_be_positive(llama_bundle):
    output = one_clear_line(generate(llama_bundle, "--prompt", "a", "--threads", "-3"), 2)
    assert "-3" in output


# -- results that were silently wrong ------------------------------------------------------------
PROMPTS = ["Simple is", "def f", "for i in", "Flat is better"]


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=1e-38),
        dict(temperature=1e-46),
        dict(temperature=5e-324),
        dict(temperature=1.0, top_p=1e-46),
        dict(temperature=0.7, top_p=1e-9, top_k=3),
    ],
    ids=["t1e-38", "t1e-46", "t-min", "topp1e-46", "topp1e-9-topk3"],
)
def test_extreme_sampling_settings_are_greedy_not_garbage(llama_generator, settings):
    """A temperature near 0 or a top-p below float precision leaves only the best token: the
    output is the greedy output, never NaN-driven garbage."""
    options = dict(max_new_tokens=16, ignore_eos=True, seed=0)
    greedy = llama_generator.generate(PROMPTS, GenerationConfig(**options))
    for k in (0, 3):
        config = GenerationConfig(num_draft_tokens=k, **options, **settings)
        sampled = llama_generator.generate(PROMPTS, config)
        assert [r.token_ids for r in sampled] == [r.token_ids for r in greedy], (k, settings)


def test_stats_count_only_tokens_that_stand(llama_bundle):
    """With frequent end-of-sequence tokens, rounds often accept draft tokens past an EOS that
    the output then drops: they are not counted as accepted."""
    probe = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=4, ignore_eos=True)
    counts = np.bincount(
        [t for r in probe.generate(PROMPTS, config) for t in r.token_ids], minlength=2
    )
    frequent = np.argsort(counts)[-3:].tolist()
    generator = SpeculativeGenerator(probe.target, probe.draft, probe.tokenizer, frequent)
    results = generator.generate(PROMPTS * 3, GenerationConfig(max_new_tokens=24, seed=1))
    stopped = [r for r in results if r.finish_reason == "stop"]
    assert stopped
    for result in results:
        stats = result.stats
        # Each round outputs its accepted draft tokens and then one token of the target's,
        # except a last round whose EOS was an accepted draft token: its own token is dropped.
        dropped = stats.rounds - (stats.new_tokens - stats.accepted_tokens)
        assert dropped in ((0, 1) if result.finish_reason == "stop" else (0,)), stats
        assert sum(stats.accepted_per_position) == stats.accepted_tokens
        assert result.token_ids[-1] in frequent or result.finish_reason == "length"


def test_prompt_longer_than_the_draft_can_hold(tmp_path):
    bundle = build_bundle(
        tmp_path, "shortdraft", arch="llama", max_positions=64, draft_max_positions=20
    )
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    prompt = list(range(3, 33))  # 30 tokens: past the draft's 20, within the target's 64
    config = dict(max_new_tokens=12, ignore_eos=True)
    [base] = generator.generate([prompt], GenerationConfig(num_draft_tokens=0, **config))
    [spec] = generator.generate([prompt], GenerationConfig(num_draft_tokens=4, **config))
    assert spec.token_ids == base.token_ids
    assert spec.stats.drafted_tokens == 0 and spec.stats.draft_stopped
    assert not base.stats.draft_stopped  # the target alone never drafts
    [short] = generator.generate([prompt[:5]], GenerationConfig(num_draft_tokens=4, **config))
    assert short.stats.drafted_tokens > 0 and not short.stats.draft_stopped


# -- messages that misled ----------------------------------------------------------------------
def test_over_long_prompt_names_the_limit_that_applies(llama_bundle):
    long_prompt = "Simple is better than complex. " * 6
    output = one_clear_line(generate(llama_bundle, "--prompt", long_prompt))
    assert "the model's own limit" in output and "--max-length" not in output
    output = one_clear_line(
        generate(llama_bundle, "--prompt", "Simple is better than complex. ", "--max-length", 20)
    )
    assert "--max-length; the model has 128" in output


def test_export_refuses_what_build_refuses(llama_bundle):
    for atol in ("0", "-1"):
        result = cli("build", "--bundle", llama_bundle, "--atol", atol)
        output = one_clear_line(result, exit_code=2)  # a usage error, as click's own
        assert f"--atol {float(atol)} must be > 0" in output  # named as the user gave it


def test_python_api_arguments_of_the_wrong_kind_are_refused_up_front(llama_bundle, tmp_path):
    """Found where they are given, with what to do, not as an AttributeError deep inside (or,
    for a hand-made Request, a model call failing or a row ending with no tokens)."""
    from specrt.errors import PromptTooLongError
    from specrt.jobs.batch import run_batch
    from specrt.runtime.batching import Request
    from specrt.runtime.generator import row_rng
    from specrt.runtime.lookup import SuffixCache

    with pytest.raises(InvalidInputError, match="suffix_cache must be a SuffixCache or None"):
        SpeculativeGenerator.from_bundle(llama_bundle, "portable")
    with pytest.raises(InvalidInputError, match="max_tokens=2.5 is a decimal number"):
        SuffixCache(2.5)
    with pytest.raises(InvalidInputError, match="max_tokens=0 is out of range"):
        SuffixCache(0)
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=4)
    config = GenerationConfig(max_new_tokens=4)
    for prompt, error, message in [
        ([], InvalidInputError, "non-empty list of token ids"),
        ([5, 10**6], InvalidInputError, "outside the vocabulary"),
        ([5] * 300, PromptTooLongError, "the prompt of request 'k' has 300 tokens"),
    ]:
        with pytest.raises(error, match=re.escape(message)):
            list(generator.run([Request("k", prompt, config, row_rng(config, 0))]))
    with pytest.raises(InvalidInputError, match="config must be a GenerationConfig"):
        list(generator.run([Request("k", [5, 6], None, row_rng(config, 0))]))
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"id": 1, "prompt": "Simple is"}\n')
    summary = run_batch(generator, str(rows), str(tmp_path / "out.jsonl"))  # str paths, defaults
    assert summary.ok == 1
    with pytest.raises(InvalidInputError, match="defaults must be a GenerationConfig"):
        run_batch(generator, rows, tmp_path / "other.jsonl", {"max_new_tokens": 2})
    with pytest.raises(InvalidInputError, match="is a directory"):
        run_batch(generator, rows, tmp_path)
    assert not (tmp_path / "other.jsonl").exists()


def test_an_empty_bundle_path_is_named_as_such():
    """`Path("")` is the working directory: "'.' is not a bundle" named a path never given."""
    from specrt.bundle import read_manifest
    from specrt.errors import BundleError

    for load in (SpeculativeGenerator.from_bundle, read_manifest):
        with pytest.raises(BundleError, match="the bundle path is empty"):
            load("")

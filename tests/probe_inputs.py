"""Probe the CLI and the Python API with bad input the way a demanding user would, and count.

    .venv/bin/python -m tests.probe_inputs [--out probes.jsonl]

Builds a tiny bundle, then runs every probe in-process and sorts the outcomes:
- clean: a failure with one line and a non-zero exit (or the library's own exception type);
- ok: success with the output of an untouched run;
- traceback: an exception other than specrt's own reached the user;
- wrong: exit 0 with another output than the untouched run, or no error where one was due;
- lost: a probe that writes left files it did not create changed or gone.
Probes: every field of a manifest set to values of every other JSON type and out-of-range
numbers; every bundle file deleted, truncated or flipped; prompt files and arguments; generation
parameters; Python API arguments; export destinations.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from click.testing import CliRunner

from specrt.cli import main
from specrt.errors import SpecrtError
from specrt.runtime import GenerationConfig, SpeculativeGenerator

WRONG_VALUES = [None, True, "x", 1.5, -1, 0, 10**9, [], {}, [1], {"a": 1}]


def run_cli(args) -> tuple[str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    if result.exit_code == 0:
        return "ok", result.output
    if isinstance(result.exception, SystemExit) and "Traceback" not in result.output:
        lines = [line for line in result.output.strip().splitlines() if line.strip()]
        return ("clean" if len(lines) <= 3 else "noisy"), result.output
    return "traceback", repr(result.exception)


def paths(value, prefix=()):
    """Every path to a field of a JSON document."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list) and value:
        yield from paths(value[0], (*prefix, 0))


def set_path(document, path, value):
    for key in path[:-1]:
        document = document[key]
    document[path[-1]] = value


def main_probe() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="one JSON line per probe")
    args = parser.parse_args()
    from specrt.export import export_bundle
    from specrt.export.tiny import make_tiny_pair

    work = Path(tempfile.mkdtemp(prefix="specrt-probe-"))
    os.environ.setdefault("SPECRT_CACHE_DIR", str(work / "cache"))
    target, draft = make_tiny_pair("llama", work / "src", draft_noise=0.3)
    pristine = work / "pristine"
    export_bundle(target, draft, pristine)
    base_args = ["--prompt", "Simple is", "--max-new-tokens", 6, "--json", "--ignore-eos"]
    status, output = run_cli(["generate", "--bundle", pristine, *base_args])
    assert status == "ok", output
    expected = json.loads(output)["token_ids"]
    records = []

    def record(kind, name, status, detail=""):
        records.append({"kind": kind, "probe": name, "status": status, "detail": detail[-300:]})

    def generate_on(bundle, kind, name, must_fail=False, extra=()):
        status, output = run_cli(["generate", "--bundle", bundle, *base_args, *extra])
        if status == "ok" and (must_fail or json.loads(output)["token_ids"] != expected):
            status = "wrong"
        record(kind, name, status, output)

    # 1. every manifest field, every wrong type
    manifest = json.loads((pristine / "manifest.json").read_text())
    for path in list(paths(manifest))[1:]:
        for value in WRONG_VALUES:
            bundle = work / "b"
            shutil.rmtree(bundle, ignore_errors=True)
            shutil.copytree(pristine, bundle)
            edited = json.loads((pristine / "manifest.json").read_text())
            set_path(edited, path, value)
            (bundle / "manifest.json").write_text(json.dumps(edited))
            generate_on(bundle, "manifest", f"{'.'.join(map(str, path))}={value!r}")

    # 2. every file deleted, truncated, flipped
    for rel in sorted(str(p.relative_to(pristine)) for p in pristine.rglob("*") if p.is_file()):
        for damage in ("delete", "truncate", "flip"):
            bundle = work / "b"
            shutil.rmtree(bundle, ignore_errors=True)
            shutil.copytree(pristine, bundle)
            path = bundle / rel
            if damage == "delete":
                path.unlink()
            elif damage == "truncate":
                path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])
            else:
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
            # the tokenizer's side files are kept for Hugging Face tools; specrt never reads them
            unused = rel.endswith(("tokenizer_config.json", "special_tokens_map.json"))
            generate_on(bundle, "files", f"{damage} {rel}", must_fail=not unused)

    # 3. prompts
    prompt_files = {
        "latin1.txt": "café\n".encode("latin-1"),
        "utf16-bom.txt": "Simple is\n".encode("utf-16"),
        "utf8-bom.txt": b"\xef\xbb\xbfSimple is\n",
        "empty.txt": b"",
        "blank.txt": b"\n \n",
        "nokey.jsonl": b'{"text": "x"}\n',
        "number.jsonl": b'{"prompt": 3}\n',
        "null.jsonl": b"null\n",
        "bool.jsonl": b"false\n",
        "object.jsonl": b'{"prompt": {"a": 1}}\n',
        "truncated.jsonl": b'{"prompt": "a\n',
        "UPPER.JSONL": b'{"prompt": "Simple is"}\n',
        "binary.bin": bytes(range(256)),
    }
    for name, content in prompt_files.items():
        (work / name).write_bytes(content)
        status, output = run_cli(["generate", "--bundle", pristine, "--prompt-file", work / name])
        record("prompt-file", name, status, output)
    for name, extra in {
        "missing file": ["--prompt-file", work / "nope.txt"],
        "directory": ["--prompt-file", work],
        "empty prompt": ["--prompt", ""],
        "spaces": ["--prompt", "   "],
        "surrogate": ["--prompt", "caf\udce9"],
        "very long": ["--prompt", "Simple is better. " * 200],
        "nul": ["--prompt", "a\x00b"],
    }.items():
        status, output = run_cli(["generate", "--bundle", pristine, *extra])
        record("prompt", name, status, output)

    # 4. parameters
    for option, values in {
        "--max-new-tokens": ["0", "-1", "1.5", "x", "99999999999999999999"],
        "--num-draft-tokens": ["-1", "65", "x", "1e3"],
        "--temperature": ["-1", "nan", "inf", "x", "1e-300", "1e300"],
        "--top-k": ["-1", "x", "1.5", "100000000"],
        "--top-p": ["0", "-0.1", "1.5", "nan", "1e-300"],
        "--seed": ["-1", "x", "1.5"],
        "--threads": ["0", "-3", "x"],
        "--max-length": ["0", "1", "x", "100000000"],
        "--engine": ["tensorrt", ""],
        "--draft-schedule": ["sometimes"],
    }.items():
        for value in values:
            status, output = run_cli(
                ["generate", "--bundle", pristine, "--prompt", "a", option, value]
            )
            record("parameter", f"{option} {value}", status, output)

    # 5. the Python API
    generator = SpeculativeGenerator.from_bundle(pristine, threads=1)
    api_calls = {
        "generate(None)": lambda: generator.generate(None),
        "generate(dict)": lambda: generator.generate({"prompt": "a"}),
        "generate(str)": lambda: generator.generate("a"),
        "generate([bytes])": lambda: generator.generate([b"a"]),
        "generate([[1.5]])": lambda: generator.generate([[1.5]]),
        "generate([[True]])": lambda: generator.generate([[True]]),
        "generate([None])": lambda: generator.generate([None]),
        "generate([[]])": lambda: generator.generate([[]]),
        "generate(config=dict)": lambda: generator.generate(["a"], {"max_new_tokens": 2}),
        "config(max_new_tokens=True)": lambda: GenerationConfig(max_new_tokens=True),
        "config(num_draft_tokens=True)": lambda: GenerationConfig(num_draft_tokens=True),
        "config(temperature='1')": lambda: GenerationConfig(temperature="1"),
        "config(seed=1.0)": lambda: GenerationConfig(seed=1.0),
        "from_bundle(threads='2')": lambda: SpeculativeGenerator.from_bundle(pristine, threads="2"),
        "from_bundle(providers=str)": lambda: SpeculativeGenerator.from_bundle(
            pristine, providers="CPUExecutionProvider"
        ),
        "from_bundle(providers=['Nope'])": lambda: SpeculativeGenerator.from_bundle(
            pristine, providers=["Nope"]
        ),
        "from_bundle(draft_threads=0)": lambda: SpeculativeGenerator.from_bundle(
            pristine, draft_threads=0
        ),
        "from_bundle(None)": lambda: SpeculativeGenerator.from_bundle(None),
        "from_bundle(max_length=True)": lambda: SpeculativeGenerator.from_bundle(
            pristine, max_length=True
        ),
    }
    for name, call in api_calls.items():
        try:
            call()
            record("api", name, "wrong", "no error")
        except SpecrtError as exc:
            record("api", name, "clean", str(exc))
        except Exception as exc:  # noqa: BLE001 - what the probe is for
            record("api", name, "traceback", f"{type(exc).__name__}: {exc}")

    # 6. export destinations: nothing we did not create may change
    def export_to(out, *extra):
        return run_cli(["export", "--target", target, "--draft", draft, "--out", out, *extra])

    for name, setup in {
        "user folder": lambda d: (d.mkdir(), (d / "keep.txt").write_text("mine")),
        "user folder --force": lambda d: (d.mkdir(), (d / "keep.txt").write_text("mine")),
        "a file": lambda d: d.write_text("mine"),
        "the checkpoint": None,
        "the checkpoints' parent": None,
    }.items():
        out = work / "dest"
        shutil.rmtree(out, ignore_errors=True)
        out.unlink(missing_ok=True)
        if name == "the checkpoint":
            out = target
        elif name == "the checkpoints' parent":
            out = target.parent
        else:
            setup(out)
        candidates = [out] if out.is_file() else list(out.rglob("*"))
        before = {p: p.read_bytes() for p in candidates if p.is_file()}
        status, output = export_to(
            out, *(["--force"] if "force" in name or "check" in name else [])
        )
        after_ok = all(p.is_file() and p.read_bytes() == b for p, b in before.items())
        record("export", name, status if after_ok else "lost", output)

    counts = Counter((r["kind"], r["status"]) for r in records)
    totals = Counter(r["status"] for r in records)
    for (kind, status), count in sorted(counts.items()):
        print(f"{kind:<12} {status:<10} {count}")
    print("total", dict(totals), f"of {len(records)} probes")
    for r in records:
        if r["status"] in ("traceback", "wrong", "lost", "noisy"):
            print(f"{r['status']}: {r['kind']} {r['probe']}: {r['detail'][-200:]!r}")
    if args.out:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in records))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main_probe()

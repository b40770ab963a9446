"""Loading bundles: checksums verified once and remembered, a consistent bundle under a
concurrent re-export, and seeded sampling that repeats bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from specrt import checksums
from specrt.bundle import read_manifest
from specrt.errors import BundleError
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.loading import load_pair
from tests.conftest import build_bundle

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def hashing(monkeypatch, tmp_path):
    """Counts the files actually read and hashed, with a fresh memory in a fresh folder."""
    monkeypatch.setenv("SPECRT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(checksums, "_memory", {})
    read = []
    real = checksums.sha256_file

    def counting(path, chunk=1 << 20):
        read.append(Path(path).name)
        return real(path, chunk)

    monkeypatch.setattr(checksums, "sha256_file", counting)
    return read


def test_files_are_hashed_once_then_remembered(llama_bundle, tmp_path, hashing):
    bundle = tmp_path / "bundle"
    shutil.copytree(llama_bundle, bundle)
    files = len(read_manifest(bundle).models["target"].all_files())
    load_pair(bundle, threads=1)
    assert len(hashing) > files
    hashing.clear()
    load_pair(bundle, threads=1)
    assert hashing == []  # remembered in this process
    code = textwrap.dedent(
        f"""
        from specrt import checksums
        from specrt.runtime.loading import load_pair
        read = []
        real = checksums.sha256_file
        checksums.sha256_file = lambda path, chunk=1 << 20: read.append(path) or real(path, chunk)
        load_pair({str(bundle)!r}, threads=1)
        print(len(read))
        """
    )
    env = {**os.environ, "SPECRT_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.stdout.strip() == "0", done.stderr  # and in the next process


def test_a_file_changed_in_place_is_hashed_again(llama_bundle, tmp_path, hashing):
    """Same size, modification time set back: the change time still tells."""
    bundle = tmp_path / "bundle"
    shutil.copytree(llama_bundle, bundle)
    load_pair(bundle, threads=1)
    graph = bundle / "draft" / "model.onnx"
    stat = graph.stat()
    data = bytearray(graph.read_bytes())
    data[-1] ^= 0xFF
    time.sleep(0.01)
    graph.write_bytes(bytes(data))
    os.utime(graph, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(BundleError, match="draft/model.onnx does not match its sha256"):
        load_pair(bundle, threads=1)


LOADED_WEIGHTS = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    import numpy as np
    from specrt.errors import BundleError
    from specrt.runtime import GenerationConfig, SpeculativeGenerator

    bundle = Path(sys.argv[1])
    weights = bundle / "target" / "onnxruntime" / "model.onnx.data"
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    outputs = [generator.generate(["Simple is"], config)[0].token_ids]
    inode = weights.stat().st_ino
    with open(weights, "r+b") as handle:  # in place: the same file, the same size
        handle.write((-np.fromfile(weights, np.float32)).tobytes())
    assert weights.stat().st_ino == inode
    outputs.append(generator.generate(["Simple is"], config)[0].token_ids)
    os.truncate(weights, 0)  # cut short: pages mapped beyond its end raised SIGBUS
    outputs.append(generator.generate(["Simple is"], config)[0].token_ids)
    try:
        SpeculativeGenerator.from_bundle(bundle, threads=1)
    except BundleError as exc:
        outputs.append(str(exc))
    print(json.dumps(outputs))
    """
)


def test_weights_rewritten_under_a_loaded_model_change_nothing(llama_bundle, tmp_path):
    """onnxruntime mapped a CPU graph's external weights and ran on the file's pages: the
    target's weights rewritten in place (sign flipped) changed a running generator's output
    silently, and the file cut short killed it with SIGBUS. A loaded model now holds its own
    copy; a new load finds the change by its checksum (the change time tells)."""
    bundle = tmp_path / "bundle"
    shutil.copytree(llama_bundle, bundle)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", LOADED_WEIGHTS, str(bundle)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    first, rewritten, truncated, reload = json.loads(done.stdout)
    assert rewritten == first and truncated == first
    assert "target/onnxruntime/model.onnx.data does not match its sha256" in reload


def test_skip_checksums_from_the_cli(llama_bundle, tmp_path, hashing):
    from click.testing import CliRunner

    from specrt.cli import main

    args = ["generate", "--bundle", str(llama_bundle), "--prompt", "a", "--max-new-tokens", "2"]
    assert CliRunner().invoke(main, [*args, "--skip-checksums"]).exit_code == 0
    assert hashing == []
    assert CliRunner().invoke(main, args).exit_code == 0
    assert hashing


WRITER = textwrap.dedent(
    """
    import shutil, sys, time
    from pathlib import Path
    from specrt.staging import publish, staging

    out, sources = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    count = 0
    while True:
        with staging(out, "partial") as staged:
            shutil.copytree(sources[count % 2], staged, dirs_exist_ok=True)
            publish(staged, out)
        count += 1
        print(count, flush=True)
        time.sleep(0.4)  # a load (~0.1 s here) reads across at most one swap
    """
)


def test_loads_during_a_concurrent_re_export_are_consistent(bundles, tmp_path, caplog):
    """A writer swaps two different real bundles into one place, over and over; every load
    meanwhile succeeds with a whole bundle (a load that read across a swap is done again)."""
    out = tmp_path / "bundle"
    shutil.copytree(bundles["llama"], out)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    sources = [str(bundles["llama"]), str(bundles["qwen2"])]
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(out), *sources], stdout=subprocess.PIPE, env=env
    )
    try:
        writer.stdout.readline()
        kinds = set()
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            pair = load_pair(out, threads=1)
            kinds.add(pair.target.spec.model_type)
    finally:
        writer.kill()
        writer.wait()
    assert kinds == {"llama", "qwen2"}  # both bundles were loaded, whole
    retried = [r for r in caplog.records if "changed while it was loading" in r.getMessage()]
    print(f"{len(retried)} loads read across a swap and were done again")


# -- seeds -----------------------------------------------------------------------------------------
SEEDED = """
import json, sys
from specrt.runtime import GenerationConfig, SpeculativeGenerator
generator = SpeculativeGenerator.from_bundle(sys.argv[1], threads=1)
prompts = ["Simple is", "def f", "for i in"]
out = {}
for schedule in ("adaptive", "heuristic", "fixed"):
    config = GenerationConfig(max_new_tokens=24, num_draft_tokens=6, temperature=1.0, seed=11,
                              ignore_eos=True, draft_schedule=schedule)
    out[schedule] = [r.token_ids for r in generator.generate(prompts, config)]
print(json.dumps(out))
"""


def test_a_seed_repeats_sampled_output_with_every_schedule(tmp_path):
    """Across calls of one generator (whose schedules learned in between) and across
    processes, the same seed gives the same tokens with every draft schedule: the target
    alone's under that seed, the same for every schedule."""
    bundle = build_bundle(tmp_path, "pair", arch="llama", seed=5, peak=45, draft_noise=0.45)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", SEEDED, str(bundle)],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            ).stdout
        )
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert runs[0]["adaptive"] == runs[0]["heuristic"] == runs[0]["fixed"]
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    prompts = ["Simple is", "def f", "for i in"]
    for schedule in ("adaptive", "heuristic"):
        config = GenerationConfig(
            max_new_tokens=24,
            num_draft_tokens=6,
            temperature=1.0,
            seed=11,
            ignore_eos=True,
            draft_schedule=schedule,
        )
        first = [r.token_ids for r in generator.generate(prompts, config)]
        unseeded = GenerationConfig(max_new_tokens=24, temperature=1.0, draft_schedule=schedule)
        generator.generate(prompts * 3, unseeded)  # the shared schedule learns meanwhile
        again = [r.token_ids for r in generator.generate(prompts, config)]
        assert first == again == runs[0][schedule], schedule


def test_the_remembered_hashes_keep_other_processes_and_no_scratch_files(tmp_path, monkeypatch):
    """A long-lived process saving its memory keeps what another process saved meanwhile
    (it overwrote it, so those files were hashed again); a cache that cannot be written
    leaves no temporary file behind (one piled up per process)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECRT_CACHE_DIR", str(cache))
    monkeypatch.setattr(checksums, "_memory", {})
    files = []
    for name in "abc":
        files.append(tmp_path / name)
        files[-1].write_text(name)
    checksums.cached_sha256(files[0])  # this process remembers a
    code = f"from specrt import checksums; checksums.cached_sha256({str(files[1])!r})"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)  # another remembers b
    checksums.cached_sha256(files[2])  # this one, c: b must stay
    saved = json.loads((cache / checksums.CACHE_FILE).read_text())
    assert sorted(Path(key).name for key in saved) == ["a", "b", "c"]
    (cache / checksums.CACHE_FILE).unlink()
    (cache / checksums.CACHE_FILE).mkdir()  # the rename can only fail
    (tmp_path / "d").write_text("d")
    checksums.cached_sha256(tmp_path / "d")
    assert sorted(p.name for p in cache.iterdir()) == [checksums.CACHE_FILE]


def test_a_memory_others_could_write_is_not_believed(llama_bundle, tmp_path, hashing):
    """Remembered hashes vouch for files: in a folder others may write in, they are not read
    (every file is hashed again) and a forged entry cannot pass a changed file."""
    bundle = tmp_path / "bundle"
    shutil.copytree(llama_bundle, bundle)
    load_pair(bundle, threads=1)
    cache = tmp_path / "cache"
    cache.chmod(0o777)
    checksums._memory.clear()
    hashing.clear()
    load_pair(bundle, threads=1)
    assert len(hashing) > 0  # not believed
    cache.chmod(0o755)
    checksums._memory.clear()
    hashing.clear()
    load_pair(bundle, threads=1)
    assert hashing == []  # the user's own, believed

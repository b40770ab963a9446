"""Nothing specrt writes loses data: --out/--force replace only specrt bundles, a bundle is in
place at every instant of a swap (real SIGKILLs of real processes), leftovers of killed runs are
cleaned up, and bundles follow the umask."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from specrt.bundle import read_manifest
from specrt.cli import main
from specrt.staging import OWNER_FILE, publish, recover, remove_stale, staging

REPO = Path(__file__).resolve().parents[1]


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def fake_bundle(directory: Path, tag: str) -> Path:
    """A directory that looks like a bundle to the swap (the swap never reads more)."""
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {"schema_version": 1, "models": {}, "tokenizer": {}, "tag": tag}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    (directory / "weights.bin").write_bytes(os.urandom(1 << 16))
    return directory


def tag(directory: Path) -> str:
    return json.loads((directory / "manifest.json").read_text())["tag"]


# -- what --out and --force may replace ----------------------------------------------------------
@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from specrt.export.tiny import make_tiny_pair

    return make_tiny_pair(out_dir=tmp_path_factory.mktemp("src") / "pair", arch="llama")


@pytest.mark.parametrize("force", [False, True])
def test_a_folder_that_is_not_a_bundle_is_never_replaced(sources, tmp_path, force):
    target, draft = sources
    user = tmp_path / "photos"
    user.mkdir()
    (user / "holiday.jpg").write_bytes(b"precious")
    args = ["export", "--target", target, "--draft", draft, "--out", user]
    result = cli(*args, *(["--force"] if force else []))
    assert result.exit_code == 1
    assert "is not a bundle specrt wrote" in result.output and "Traceback" not in result.output
    assert (user / "holiday.jpg").read_bytes() == b"precious"
    assert sorted(p.name for p in user.iterdir()) == ["holiday.jpg"]


@pytest.mark.parametrize("where", ["target", "parent of target", "draft"])
def test_out_never_replaces_a_source_checkpoint(sources, where):
    target, draft = sources
    out = {"target": target, "parent of target": target.parent, "draft": draft}[where]
    before = sorted(str(p) for p in out.rglob("*"))
    result = cli("export", "--target", target, "--draft", draft, "--out", out, "--force")
    assert result.exit_code == 1 and "source checkpoint" in result.output, result.output
    assert sorted(str(p) for p in out.rglob("*")) == before


def test_out_is_the_working_directory(sources, tmp_path, monkeypatch):
    target, draft = sources
    here = tmp_path / "work" / "here"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    (here / "notes.txt").write_text("mine")
    for out in (".", "..", tmp_path / "work"):
        result = cli("export", "--target", target, "--draft", draft, "--out", out, "--force")
        assert result.exit_code == 1 and "current directory" in result.output, result.output
    assert (here / "notes.txt").read_text() == "mine"


MOUNTS = [p for p in ("/dev/shm", "/proc", "/sys") if os.path.ismount(p)]


@pytest.mark.skipif(not MOUNTS, reason="no mount point to try here")
def test_out_that_is_a_mount_point_is_named_before_any_work(sources, tmp_path):
    """A bundle is swapped in by renaming, which a mount point (a container's volume) cannot
    take: it failed after the whole export as "Device or resource busy"."""
    target, draft = sources
    out = Path(MOUNTS[0])
    result = cli("export", "--target", target, "--draft", draft, "--out", out, "--force")
    assert result.exit_code == 1 and f"--out {out} is a mount point" in result.output
    assert "exporting" not in result.output and "Traceback" not in result.output


def test_out_that_is_a_file(sources, tmp_path):
    target, draft = sources
    (tmp_path / "file").write_text("x")
    result = cli("export", "--target", target, "--draft", draft, "--out", tmp_path / "file")
    assert result.exit_code == 1 and "is not a directory" in result.output
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_staging_folder_that_cannot_be_made_is_named_by_the_path_asked_for():
    """Nothing can be made in /proc: the error named the hidden staging folder (".draft.gguf-PID-
    XXXX", never made) where the user wrote --out /proc/draft."""
    out = Path("/proc/specrt-out")
    with pytest.raises(OSError) as raised:
        with staging(out, "gguf"):
            pass
    assert raised.value.filename == str(out)


def test_force_replaces_a_bundle_and_nothing_is_left_beside_it(sources, tmp_path):
    target, draft = sources
    out = tmp_path / "bundle"
    args = ["export", "--target", target, "--draft", draft, "--out", out, "--no-ort-engine"]
    assert cli(*args).exit_code == 0
    first = read_manifest(out)
    result = cli(*args)
    assert result.exit_code == 1 and "pass --force" in result.output
    assert cli(*args, "--force").exit_code == 0
    assert read_manifest(out).models["target"].files == first.models["target"].files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def test_force_keeps_what_a_user_put_in_the_bundle(sources, tmp_path):
    """`export --force` over a bundle deleted a file the user had put in it (exit 0, not a
    word; `build` keeps it): what specrt did not write is carried into the new bundle, its mode
    kept, and named; one the new bundle would overwrite is refused and the bundle left as it was."""
    target, draft = sources
    out = tmp_path / "bundle"
    args = ["export", "--target", target, "--draft", draft, "--out", out, "--no-ort-engine"]
    assert cli(*args).exit_code == 0
    (out / "MY_NOTES.txt").write_text("notes\n")
    (out / "MY_NOTES.txt").chmod(0o600)
    (out / "target" / "mine").mkdir()
    (out / "target" / "mine" / "eval.csv").write_text("a,b\n")
    (out / "latest").symlink_to("MY_NOTES.txt")
    mine = ["MY_NOTES.txt", "latest", "target/mine/eval.csv"]
    result = cli(*args, "--force")
    assert result.exit_code == 0, result.output
    assert f"kept 3 file(s) in {out} that specrt did not write: {', '.join(mine)}" in result.output
    assert (out / "MY_NOTES.txt").read_text() == "notes\n"
    assert (out / "MY_NOTES.txt").stat().st_mode & 0o777 == 0o600
    assert (out / "target" / "mine" / "eval.csv").read_text() == "a,b\n"
    assert os.readlink(out / "latest") == "MY_NOTES.txt"
    assert read_manifest(out).models["target"].num_layers == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]

    # a file of the user's where the new bundle writes one of its own (its engines): refused
    (out / "target" / "onnxruntime").mkdir()
    (out / "target" / "onnxruntime" / "model.onnx").write_text("mine")
    before = (out / "manifest.json").read_text()
    result = cli(*args[:-1], "--force")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"{out}/target/onnxruntime/model.onnx is not part of the bundle" in result.output
    assert (out / "target" / "onnxruntime" / "model.onnx").read_text() == "mine"
    assert (out / "manifest.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def test_force_keeps_the_corpus_only_where_the_tokenizer_is_the_same(sources, tmp_path):
    """A corpus (`specrt corpus`) holds token ids of the bundle's tokenizer: `export --force`
    with another tokenizer kept it as a user's file, and the new bundle did not load."""
    from specrt.export.tiny import make_tiny_pair
    from specrt.runtime import SpeculativeGenerator

    target, draft = sources
    out = tmp_path / "bundle"
    args = ["export", "--out", out, "--no-ort-engine", "--force"]
    assert cli(*args, "--target", target, "--draft", draft).exit_code == 0
    text = tmp_path / "text.txt"
    text.write_text("Simple is better than complex. Flat is better than nested.\n")
    assert cli("corpus", "--bundle", out, "--text-file", text).exit_code == 0
    same = cli(*args, "--target", target, "--draft", draft)
    assert same.exit_code == 0 and "kept its corpus" in same.output, same.output
    assert "did not write" not in same.output and (out / "corpus" / "ngrams.npz").is_file()
    other_target, other_draft = make_tiny_pair("llama", tmp_path / "other", extra_tokens=3)
    other = cli(*args, "--target", other_target, "--draft", other_draft)
    assert other.exit_code == 0 and "built for the old tokenizer" in other.output, other.output
    assert not (out / "corpus" / "ngrams.npz").exists()
    SpeculativeGenerator.from_bundle(out)  # loads: no corpus of another tokenizer in it


def test_force_through_a_symbolic_link_replaces_the_bundle_it_points_to(sources, tmp_path):
    """`export --force` to engines/demo -> a bundle kept elsewhere said "exists and is not a
    directory"; the docs promise the link is followed and kept, as `build` does."""
    target, draft = sources
    real = tmp_path / "store" / "bundle"
    args = ["export", "--target", target, "--draft", draft, "--no-ort-engine"]
    assert cli(*args, "--out", real).exit_code == 0
    before = read_manifest(real)
    link = tmp_path / "engines" / "demo"
    link.parent.mkdir()
    link.symlink_to(Path("..") / "store" / "bundle")
    result = cli(*args, "--out", link)
    assert result.exit_code == 1 and "pass --force to replace it" in result.output
    result = cli(*args, "--out", link, "--force")
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and os.readlink(link) == str(Path("..") / "store" / "bundle")
    assert read_manifest(real).models["target"].files == before.models["target"].files
    assert sorted(p.name for p in real.parent.iterdir()) == ["bundle"]
    assert sorted(p.name for p in link.parent.iterdir()) == ["demo"]
    (tmp_path / "elsewhere").write_text("a file")
    (tmp_path / "engines" / "file").symlink_to(tmp_path / "elsewhere")
    result = cli(*args, "--out", tmp_path / "engines" / "file", "--force")
    assert result.exit_code == 1 and "exists and is not a directory" in result.output
    assert (tmp_path / "elsewhere").read_text() == "a file"


# -- the swap ------------------------------------------------------------------------------------
def test_publish_replaces_and_removes_the_old(tmp_path):
    out = fake_bundle(tmp_path / "b", "old")
    with staging(out, "partial") as staged:
        fake_bundle(staged, "new")
        publish(staged, out)
    assert tag(out) == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


SWAPPER = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path
    from specrt import staging

    out, mode = Path(sys.argv[1]), sys.argv[2]
    if mode != "exchange":
        staging._exchange = lambda a, b: False  # the two-rename path of other systems
    if mode == "die-between-renames":
        real_replace = os.replace

        def replace(a, b):
            real_replace(a, b)
            if Path(b).name.endswith(".specrt-old"):
                os.kill(os.getpid(), signal.SIGKILL)

        os.replace = replace
    count = 0
    while True:
        count += 1
        with staging.staging(out, "partial") as staged:
            staged.joinpath("manifest.json").write_text(json.dumps(
                {"schema_version": 1, "models": {}, "tokenizer": {}, "tag": str(count)}))
            staged.joinpath("weights.bin").write_bytes(os.urandom(1 << 16))
            staging.publish(staged, out)
        print(count, flush=True)
    """
)


def run_swapper(out: Path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", SWAPPER, str(out), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )


@pytest.mark.parametrize("mode", ["exchange", "renames"])
def test_a_bundle_survives_sigkill_at_any_moment(tmp_path, mode):
    """A writer swapping bundles in a loop is SIGKILLed at 12 random moments; after each the
    bundle loads (recovered if it was parked) and the next writer cleans the leftovers."""
    out = fake_bundle(tmp_path / "b", "0")
    rng = __import__("random").Random(mode)
    for _ in range(12):
        process = run_swapper(out, mode)
        process.stdout.readline()  # it is swapping
        time.sleep(rng.uniform(0, 0.05))
        process.send_signal(signal.SIGKILL)
        process.wait()
        recover(out)
        assert (out / "manifest.json").is_file()
        tag(out)  # a whole manifest
    remove_stale(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_killed_between_the_two_renames_is_recovered_on_load(tmp_path, llama_bundle):
    """The two-rename path's window, hit for certain: the writer SIGKILLs itself right after
    parking the old bundle. The bundle is gone from its place until the next read, which puts it
    back; the next writer removes the dead one's staging directory."""
    out = tmp_path / "bundle"
    shutil.copytree(llama_bundle, out)
    process = run_swapper(out, "die-between-renames")
    process.wait()
    assert process.returncode == -signal.SIGKILL
    assert not out.exists() and (tmp_path / ".bundle.specrt-old").is_dir()
    assert read_manifest(out).models["target"].num_layers == 2  # recovered
    assert not (tmp_path / ".bundle.specrt-old").exists()
    assert not (out / ".specrt-parked").exists()
    leftovers = list(tmp_path.glob(".bundle.partial-*"))
    assert len(leftovers) == 1
    with staging(out, "build"):
        assert not leftovers[0].exists()


def test_interrupt_between_the_two_renames_keeps_the_old_bundle(tmp_path, monkeypatch):
    from specrt import staging as staging_module

    out = fake_bundle(tmp_path / "b", "old")
    monkeypatch.setattr(staging_module, "_exchange", lambda a, b: False)
    real_replace = os.replace

    def replace(a, b):
        if Path(a).name.startswith(".b.partial-"):
            raise KeyboardInterrupt
        real_replace(a, b)

    monkeypatch.setattr(staging_module.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt), staging(out, "partial") as staged:
        fake_bundle(staged, "new")
        publish(staged, out)
    assert tag(out) == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_only_dead_writers_leftovers_are_removed(tmp_path):
    """Staging directories of writers that are gone (the pid in the name, or an earlier
    version's marker) and a bundle parked with its mark are removed; a user's folders that
    merely look alike (a backup named .b.old, .b.build-userdata) are not: they were deleted."""
    out = fake_bundle(tmp_path / "b", "current")
    dead = (
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
        .stdout.decode()
        .strip()
    )
    leftovers = {
        "dead": (tmp_path / f".b.build-{dead}-x1y2", None),
        "dead, earlier version": (tmp_path / ".b.partial-dead", dead),
        "no marker": (tmp_path / ".b.build-userdata", None),
        "live": (tmp_path / f".b.partial-{os.getpid()}-abc", None),
        "live, earlier version": (tmp_path / ".b.partial-live", str(os.getpid())),
    }
    for path, pid in leftovers.values():
        path.mkdir()
        (path / "precious.txt").write_text("mine")
        if pid is not None:
            (path / OWNER_FILE).write_text(pid)
    other = tmp_path / ".b.partial.txt"
    other.write_text("not ours")
    mine = tmp_path / ".c.partial-x"
    mine.mkdir()
    backup = fake_bundle(tmp_path / ".b.old", "backup")
    parked_unmarked = fake_bundle(tmp_path / ".b.specrt-old", "the user's")
    removed = remove_stale(out)
    assert sorted(p.name for p in removed) == [f".b.build-{dead}-x1y2", ".b.partial-dead"]
    kept = [leftovers[name][0] for name in ("no marker", "live", "live, earlier version")]
    assert all(path.is_dir() for path in kept) and other.is_file() and mine.is_dir()
    assert tag(backup) == "backup" and tag(parked_unmarked) == "the user's"
    shutil.rmtree(out)  # a user's look-alike is not taken for a parked bundle either
    assert not recover(out) and not out.exists()
    (parked_unmarked / ".specrt-parked").write_text(dead)  # one parked by a killed writer
    assert recover(out) and tag(out) == "the user's" and not (out / ".specrt-parked").exists()


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_bundles_follow_the_umask(tmp_path, umask):
    script = textwrap.dedent(
        """
        import os, sys
        from pathlib import Path
        from specrt import staging
        out = Path(sys.argv[1])
        with staging.staging(out, "partial") as staged:
            (staged / "sub").mkdir()
            (staged / "sub" / "weights.bin").write_bytes(b"w")
            (staged / "manifest.json").write_text("{}")
            os.chmod(staged / "manifest.json", 0o600)  # as a tool that writes private files
            staging.publish(staged, out)
        """
    )
    out = tmp_path / "b"
    subprocess.run(
        [sys.executable, "-c", f"import os; os.umask({umask}); exec({script!r})", str(out)],
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    for path in [out, out / "sub"]:
        assert path.stat().st_mode & 0o777 == 0o777 & ~umask
    for path in [out / "manifest.json", out / "sub" / "weights.bin"]:
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_exported_bundles_are_readable_by_others_under_umask_022(llama_bundle):
    from specrt.staging import current_umask

    if current_umask() != 0o022:
        pytest.skip(f"this test's process runs under umask {current_umask():o}, not 022")
    for path in [llama_bundle, *llama_bundle.rglob("*")]:
        expected = 0o755 if path.is_dir() else 0o644
        assert path.stat().st_mode & 0o777 == expected, path


def test_a_bundle_behind_a_symbolic_link_is_replaced_where_it_is(tmp_path):
    """engines/demo -> a bundle kept elsewhere: a build or a forced export replaces that
    bundle; the link is the user's and stays a link (it became a folder, the real bundle stayed
    old, and a link to it was left beside it)."""
    real = tmp_path / "store" / "bundle"
    real.mkdir(parents=True)
    (real / "manifest.json").write_text("old")
    link = tmp_path / "engines" / "demo"
    link.parent.mkdir()
    link.symlink_to(Path("..") / "store" / "bundle")
    with staging(link, "build") as scratch:
        (scratch / "manifest.json").write_text("new")
        publish(scratch, link)
    assert link.is_symlink() and (real / "manifest.json").read_text() == "new"
    assert sorted(p.name for p in link.parent.iterdir()) == ["demo"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["bundle"]


@pytest.mark.parametrize(
    "signum, status, line",
    [(signal.SIGINT, 130, "interrupted (Ctrl-C)"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
)
def test_a_build_stopped_by_ctrl_c_or_sigterm_says_so_and_leaves_nothing(
    llama_bundle, tmp_path, signum, status, line
):
    """Ctrl-C mid-build ended in click's "Aborted!" and status 1; SIGTERM (systemd, k8s,
    timeout) killed it silently and left its 36 MB staging directory. Now either is one line,
    130 / 143 as a shell reports them, the bundle as it was and nothing left beside it."""
    bundle = tmp_path / "b"
    shutil.copytree(llama_bundle, bundle)
    before = (bundle / "manifest.json").read_bytes()
    process = subprocess.Popen(
        [sys.executable, "-m", "specrt.cli", "build", "--bundle", str(bundle)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while process.poll() is None and not list(tmp_path.glob(".b.build-*")):
        assert time.monotonic() < deadline, "the build never started"
        time.sleep(0.01)
    assert process.poll() is None, "the build ended before it could be stopped"
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == status, stderr
    assert stderr.strip().splitlines()[-1] == line and "Traceback" not in stderr, stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    assert (bundle / "manifest.json").read_bytes() == before

"""TensorRT without TensorRT: the provider options and profiles generated from the manifest, the
refusal of a plan built elsewhere, and clear errors where tensorrt or a GPU is missing."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from specrt.backends.base import PREFILL_CHUNK
from specrt.backends.tensorrt import MAX_NEW_POSITIONS, check_plan, ep_options, profiles
from specrt.bundle import read_manifest
from specrt.cli import main
from specrt.errors import BundleError


def parse(option: str) -> list[tuple[str, tuple[int, ...]]]:
    pairs = []
    for item in option.split(","):
        name, dims = item.split(":")
        pairs.append((name, tuple(int(d) for d in dims.split("x"))))
    return pairs


@pytest.mark.parametrize("role", ["target", "draft"])
def test_ep_options_carry_two_profiles_from_the_manifest(llama_bundle, tmp_path, role):
    spec = read_manifest(llama_bundle).models[role]
    options = ep_options(spec, tmp_path, role, max_length=100)
    assert options["trt_fp16_enable"] == "True"
    assert options["trt_engine_cache_path"] == str(tmp_path / role / "tensorrt-ep-cache")
    shapes = {key: parse(options[f"trt_profile_{key}_shapes"]) for key in ("min", "opt", "max")}
    names = [name for name, _ in shapes["min"]]
    inputs = [spec.io.input_ids, spec.io.attention_mask, spec.io.position_ids]
    inputs += spec.io.past_keys + spec.io.past_values
    assert sorted(names) == sorted(inputs * 2)  # every input, in two profiles
    assert [n for n, _ in shapes["opt"]] == names == [n for n, _ in shapes["max"]]
    for max_length in (100, 8, 2):
        options = ep_options(spec, tmp_path, role, max_length=max_length)
        ranges = [parse(options[f"trt_profile_{key}_shapes"]) for key in ("min", "opt", "max")]
        for (_, low), (_, opt), (_, high) in zip(*ranges):
            assert all(a <= b <= c for a, b, c in zip(low, opt, high)), (low, opt, high)
    decode, prefill = profiles(spec, 100, role)
    assert decode[spec.io.input_ids][1] == ((1, 1) if role == "draft" else (1, 5))
    assert decode[spec.io.input_ids][2] == (1, min(MAX_NEW_POSITIONS, 100))
    assert prefill[spec.io.input_ids][2] == (1, min(PREFILL_CHUNK, 100))
    past = decode[spec.io.past_keys[0]]
    assert past[0] == (1, spec.num_kv_heads, 0, spec.head_dim)
    assert past[2] == (1, spec.num_kv_heads, 99, spec.head_dim)
    assert decode[spec.io.attention_mask][2] == (1, 100)


def test_a_plan_from_another_gpu_or_version_is_refused():
    here = {"gpu": "NVIDIA H200", "compute_capability": "9.0", "tensorrt": "10.13.0"}
    check_plan(dict(here), here, "target")
    for key, other in (("gpu", "NVIDIA A100"), ("compute_capability", "8.0"), ("tensorrt", "10.1")):
        with pytest.raises(BundleError, match="specrt build --bundle DIR --tensorrt") as caught:
            check_plan({**here, key: other}, here, "draft")
        assert other in str(caught.value)


def test_build_tensorrt_without_tensorrt_changes_nothing(llama_bundle, tmp_path):
    pytest.importorskip("onnx")
    try:
        import tensorrt  # noqa: F401

        pytest.skip("tensorrt is installed here: this test is about machines without it")
    except ImportError:
        pass
    bundle = tmp_path / "bundle"
    shutil.copytree(llama_bundle, bundle)
    before = (bundle / "manifest.json").read_bytes()
    result = CliRunner().invoke(main, ["build", "--bundle", str(bundle), "--tensorrt"])
    assert result.exit_code == 1 and "TensorRT is not installed" in result.output
    assert "pip install 'specrt[tensorrt]'" in result.output
    assert (bundle / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


def test_engine_tensorrt_needs_plans_and_tensorrt(llama_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(llama_bundle, bundle)
    args = ["generate", "--bundle", str(bundle), "--prompt", "a", "--engine", "tensorrt"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "--tensorrt" in result.output  # no plans: how to build them
    # a manifest that lists plans (as built on a GPU machine): this machine cannot run them
    plan = bundle / "target" / "tensorrt" / "model.plan"
    plan.parent.mkdir()
    plan.write_bytes(b"plan")
    data = json.loads((bundle / "manifest.json").read_text())
    from specrt.checksums import sha256_file

    entry = {
        "path": "target/tensorrt/model.plan",
        "files": {"target/tensorrt/model.plan": sha256_file(plan)},
        "io": data["models"]["target"]["io"],
        "vocab_size": data["models"]["target"]["vocab_size"],
        "cache": "concat",
        "precision": "float16",
        "provider": "TensorRT",
        "built_for": {"gpu": "NVIDIA H200", "tensorrt": "10.13.0", "compute_capability": "9.0"},
    }
    data["models"]["target"]["engines"]["tensorrt"] = entry
    data["models"]["draft"]["engines"]["tensorrt"] = {
        **entry,
        "path": "target/tensorrt/model.plan",
        "io": data["models"]["draft"]["io"],
    }
    (bundle / "manifest.json").write_text(json.dumps(data))
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "TensorRT is not installed" in result.output and "Traceback" not in result.output
    # the other engines of the same bundle still run
    assert CliRunner().invoke(main, [*args[:-1], "auto"]).exit_code == 0


def test_a_gpu_that_nvidia_smi_cannot_see_is_one_line(tmp_path):
    """A container with TensorRT installed but no driver: nvidia-smi is there and fails (a
    CalledProcessError traceback)."""
    import os
    import subprocess
    import sys

    (tmp_path / "tensorrt").mkdir()  # the package's presence is all that is asked of it here
    (tmp_path / "tensorrt" / "__init__.py").write_text('__version__ = "10.13.0"\n')
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: no driver' >&2\nexit 9\n")
    smi.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.getcwd()}"}
    env["PATH"] = f"{tmp_path}{os.pathsep}{env['PATH']}"
    code = "from specrt.backends.tensorrt import gpu_identity; gpu_identity()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "CalledProcessError" not in done.stderr
    assert "nvidia-smi finds no GPU here (NVIDIA-SMI has failed: no driver)" in done.stderr

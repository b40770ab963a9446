"""The device check runs end to end here as a dry run (tiny shapes, the CUDA path on the CPU
under CUDA's rule for host inputs): on the GPU machine the same script only changes sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "report.json"
    command = [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run"]
    command += ["--prompts", "2", "--new-tokens", "8", "--max-k", "2"]
    command += ["--batch-sizes", "1", "3", "--batch-prompts", "5"]
    command += ["--work", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    assert set(report["pairs"]) == {"demo", "llama-1b-shaped"}
    for entry in report["pairs"].values():
        assert entry["greedy_equals_target_only"] is True
        assert entry["device"] == "cuda"  # the CUDA path, under tests/cuda_rule.py
        assert {"target only", "K=1", "K=2", "adaptive K<=2"} <= set(entry["results"])
        assert entry["results"]["K=2"]["bytes_to_host_per_round"] < 1000  # argmax, not logits
        assert 0 < entry["cost_ratio"]
        kept = entry["kept_rows"]  # a finished row's cache copied on the device
        assert kept["equals_target_only"] is True and kept["cached_tokens"] >= 16
        processors = dict(entry["processors"])
        assert processors.pop("structured") == {"equals_target_only": [True] * 3}
        for checked in processors.values():  # the bias, penalties and logprobs
            assert checked == {"equals_target_only": [True] * 3,
                               "prompt_logprobs_agree": [True] * 3}  # fmt: skip
        if "group_query_one_row" in entry:  # the demo pair: the one-row graph beside it
            assert set(entry["group_query_one_row"]) == {"target only", "K=4"}
        for batch in ("1", "3"):  # rows per call on the device backend; the one-row reference
            result = entry["batches"][batch]
            assert result["max_batch"] == int(batch) and result["device"] == "cuda"
            for mode in ("target only", "speculative"):
                assert result[mode]["rows_equal_one_row_target_only"] == result[mode]["rows"] == 5
    assert "greedy == target-only True" in done.stdout
    assert "group_query_one_row" in report["pairs"]["demo"]
    head = report["pairs"]["demo"]["eagle_head"]  # the demo head, on the cuda engines
    assert set(head) == {"target only", "head K=2", "head K=4", "head adaptive"}
    assert all(result["equals_target_only"] for result in head.values())
    assert head["head K=4"]["acceptance_rate"] > 0.2


def test_pairs_are_built_before_their_budgets(tmp_path):
    """Building the 1B-shaped pair (~150 s on 2 cores) came out of a budget shared with the
    demo pair's measuring, and its table went missing. Now both are built first and each pair
    measures within its own budget; past it the probes after the contenders say so. The host
    inputs probe times the target alone with each `host_inputs.TRANSFER`."""
    out = tmp_path / "report.json"
    command = [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run"]
    command += ["--prompts", "1", "--new-tokens", "4", "--max-k", "1"]
    command += ["--batch-sizes", "1", "--batch-prompts", "2"]
    command += ["--demo-budget-s", "0", "--llama-budget-s", "600"]
    command += ["--work", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["build_s"] > 0
    demo, llama = report["pairs"]["demo"], report["pairs"]["llama-1b-shaped"]
    assert (demo["budget_s"], llama["budget_s"]) == (0, 600)
    assert demo["batches"]["1"] == {"skipped": "out of time"}  # no time to measure: no runs
    assert demo["host_inputs"] == demo["group_query_one_row"] == {"skipped": "out of time"}
    assert demo["greedy_equals_target_only"] is True  # the exactness check runs all the same
    assert set(demo["results"]["K=1"]) == {"skipped"}  # and the target alone, the base
    assert "tokens_per_second" in demo["results"]["target only"]
    assert not [key for entry in (demo, llama) for key in entry if key.endswith("_failed")]
    assert llama["batches"]["1"]["target only"]["rows"] == 2  # the other pair's own budget
    probe = llama["host_inputs"]
    assert set(probe) == {"rebind", "update", "same_tokens"} and probe["same_tokens"] is True


def test_a_failing_phase_costs_only_itself(tmp_path):
    """A phase that raised (here the batches, asked for a batch of 0 rows) ended the whole run
    with no report: on a GPU's first run, minutes of results lost. Now it is recorded and the
    other phases run."""
    out = tmp_path / "report.json"
    command = [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run"]
    command += ["--prompts", "1", "--new-tokens", "4", "--max-k", "1"]
    command += ["--batch-sizes", "0", "--batch-prompts", "2"]
    command += ["--work", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for entry in json.loads(out.read_text())["pairs"].values():
        assert "max_batch=0" in entry["batches_failed"]
        assert entry["greedy_equals_target_only"] is True  # the next phase ran
    assert "batches_failed" in done.stdout


def test_the_verification_probe_runs_as_a_dry_run(tmp_path):
    """bench/gpu_attention.py (why a pass over several positions costs what it does on CUDA)
    runs end to end here: every part, every form; the index forms of the greedy tail give
    numpy's argmax on rows holding ties."""
    command = [sys.executable, str(REPO / "bench" / "gpu_attention.py"), "--dry-run"]
    done = subprocess.run(
        [*command, "--out", str(tmp_path), "--work", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_attention.json").read_text())
    assert set(report["steps"]) == {
        "direct, default",
        "direct, no memory-efficient attention",
        "direct, no flash attention",
        "chunked, default",
        "by length, default",
    }
    for steps in report["steps"].values():
        assert set(steps) == {"1", "2", "3", "5", "9"} and all(ms > 0 for ms in steps.values())
    forms = report["ops"]["rows=1 n=2"]
    for label in ("mask23", "bias23", "nonpad24", "scatter_nd_write", "tensor_scatter_write"):
        assert forms[label]["ms"] > 0, (label, forms[label])
    assert forms["nonpad24"]["max_diff_vs_mask23"] == 0  # the same attention, without a mask
    for case in report["tail"].values():
        indices = [entry for entry in case.values() if "equals_numpy_argmax" in entry]
        assert len(indices) == 4 and all(entry["equals_numpy_argmax"] for entry in indices)

"""The KV cache's memory budget: rows and positions derived from it and the model's per-position
size, as `specrt batch` and `specrt serve` take it (`--kv-cache-memory`)."""

from __future__ import annotations

import json
import sys

import pytest

from specrt.bundle import read_manifest
from specrt.errors import InvalidInputError
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.memory import available_memory, bytes_per_position, parse_size, plan_cache
from tests.test_batch_job import command, run

CPU = ["CPUExecutionProvider"]


@pytest.mark.parametrize(
    "text, size",
    [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5g", 1_500_000_000),
     ("1000", 1000), ("64kib", 65536), ("auto", None)],
)  # fmt: skip
def test_sizes_read_as_people_write_them(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "-1GiB", "0", "4 parsecs", ""])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(InvalidInputError, match="not a memory size"):
        parse_size(text)


def test_a_position_costs_what_the_loaded_caches_take(llama_bundle):
    """The plan's per-position bytes are the decoders' own: one row at max_length positions."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_length=64)
    per_row = generator.target.cache_bytes_per_row + generator.draft.cache_bytes_per_row
    assert bytes_per_position(read_manifest(llama_bundle), "auto", CPU) * 64 == per_row


def test_rows_are_as_many_as_the_budget_holds(llama_bundle):
    manifest = read_manifest(llama_bundle)
    per = bytes_per_position(manifest, "auto", CPU)
    plan = plan_cache(manifest, 3 * 100 * per, 16, 100, "auto", CPU)
    assert (plan.max_batch, plan.max_length) == (3, 100) and plan.bytes <= 3 * 100 * per
    roomy = plan_cache(manifest, 10**12, 16, 100, "auto", CPU)
    assert (roomy.max_batch, roomy.max_length) == (16, 100)
    short = plan_cache(manifest, 60 * per, 16, 100, "auto", CPU)  # not one whole row
    assert (short.max_batch, short.max_length) == (1, 60)
    capped = plan_cache(manifest, 10**12, 2, 10**9, "auto", CPU)  # the model's own limit
    assert capped.max_length == manifest.models["target"].max_positions
    with pytest.raises(InvalidInputError, match="holds 3 positions"):
        plan_cache(manifest, 3 * per, 16, 100, "auto", CPU)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("NOT A MANIFEST", None, 8, 64), "takes a bundle's Manifest"),
        ((None, "lots", 8, 64), "is not a memory size"),
        ((None, 1.5e6, 8, 64), "--kv-cache-memory=1500000.0 is a decimal number"),
        ((None, None, 0, 64), "max_batch=0 is out of range"),  # gave rows past the models'
        ((None, None, 8.5, 64), "max_batch=8.5 is a decimal number"),
        ((None, None, 8, 0), "max_length=0 is out of range"),  # ZeroDivisionError
    ],
)
def test_plan_cache_checks_what_it_is_given(llama_bundle, args, message):
    manifest, *rest = args
    manifest = 3 if manifest == "NOT A MANIFEST" else read_manifest(llama_bundle)
    with pytest.raises(InvalidInputError, match=message):
        plan_cache(manifest, *rest)
    by_path = plan_cache(llama_bundle, "1MiB", 2, 64)  # a directory and a size, as the CLI
    assert by_path == plan_cache(read_manifest(llama_bundle), 2**20, 2, 64)


def test_an_automatic_budget_is_half_the_memory_available(llama_bundle):
    manifest = read_manifest(llama_bundle)
    plan = plan_cache(manifest, None, 4, 100, "auto", CPU)
    assert plan.budget <= available_memory() // 2 + 2**20 and "auto" in plan.source
    gpu = plan_cache(manifest, None, 4, 100, "auto", ["CUDAExecutionProvider"])
    assert (gpu.max_batch, gpu.max_length, gpu.budget) == (4, 100, None)


def test_specrt_batch_keeps_its_cache_within_the_budget(llama_bundle, tmp_path):
    """16 rows asked for, room for 3 of 40 positions: the job says so, runs 3 per call, and
    its cache never grows past the budget."""
    per = bytes_per_position(read_manifest(llama_bundle), "auto", CPU)
    rows = tmp_path / "in.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": "def f"}) + "\n" for i in range(6)))
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    budget = str(3 * 40 * per)
    done = run(
        command(llama_bundle, rows, out, "--batch-size", "16", "--max-length", "40",
                "--max-new-tokens", "8", "--kv-cache-memory", budget, "--summary", str(summary))
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "3 rows x 40 positions" in done.stderr and "--kv-cache-memory" in done.stderr
    report = json.loads(summary.read_text())
    assert report["batch_size"] == 3 and report["cache_bytes"] <= int(budget)
    assert len(out.read_text().splitlines()) == 6
    bad = run(command(llama_bundle, rows, out, "--kv-cache-memory", "lots"))
    assert bad.returncode == 2 and "not a memory size" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_specrt_serve_takes_the_slots_its_budget_holds(llama_bundle, tmp_path):
    """16 slots asked for, room for 3 of 40 positions: the start line says so, and 6 requests
    at once are all answered (3 run, the others wait for a slot)."""
    import httpx

    from tests.test_serve import logged, running_server

    per = bytes_per_position(read_manifest(llama_bundle), "auto", CPU)
    log = tmp_path / "serve.log"
    budget = ["--batch-size", "16", "--max-length", "40", "--kv-cache-memory", str(3 * 40 * per)]
    with running_server(llama_bundle, *budget, log=log) as (url, _):
        line = logged(log, "KV cache")
        assert "3 requests x 40 positions" in line and "taken at start" in line
        body = {"prompt": "Simple is", "max_tokens": 8, "ignore_eos": True}
        with httpx.Client(timeout=60) as client:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(6) as pool:
                answers = list(
                    pool.map(lambda _: client.post(f"{url}/v1/completions", json=body), range(6))
                )
        assert [a.status_code for a in answers] == [200] * 6
    refused = run(
        [sys.executable, "-m", "specrt.cli", "serve", "--bundle", str(llama_bundle),
         "--port", "0", "--kv-cache-memory", "10"]
    )  # fmt: skip
    assert refused.returncode != 0 and "holds 0 positions" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.parametrize("max_batch", [1, 4])
def test_calls_of_every_shape_write_their_outputs_into_one_buffer(llama_bundle, max_batch):
    """Host outputs of each call shape (rows x positions kept x vocabulary) in arrays of their
    own would add up over a job's shapes, each paying page faults on first write: every shape
    shares the largest one's memory (tracemalloc counts numpy's allocations), but for a call
    that is not repeated."""
    import tracemalloc

    import numpy as np

    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1, max_batch=max_batch)
    target = generator.target
    target.prefill_rows(0, [[5, 6, 7]] * max_batch)
    shapes = [(n, width) for width in range(1, 7) for n in range(1, max_batch + 1)]

    def call(n: int, width: int):
        out = target.forward_rows(np.full((n, width), 3, dtype=np.int64), keep_last=width)
        for row in range(n):
            target.set_length(row, 3)
        return out

    tracemalloc.start()
    try:
        for shape in shapes:
            call(*shape)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    largest = call(max_batch, 6)
    outputs = 2 if largest.probabilities is not None else 1
    assert peak < 3 * outputs * largest.logits.nbytes + 2**20  # not the sum over 6 x n shapes
    for shape in shapes:  # now every shape's arrays are views of that one buffer
        assert np.shares_memory(call(*shape).logits, largest.logits)
    # A call of many tokens (a prompt's log-probabilities) has outputs of its own, freed with
    # it: the buffer keeps the size of the calls that repeat.
    assert not np.shares_memory(call(1, 100).logits, largest.logits)
    assert np.shares_memory(call(max_batch, 6).logits, largest.logits)

"""`specrt batch`: a real subprocess, killed with SIGKILL at several points and rerun, loses no
row and writes none twice; bad rows become error records and the job goes on. The reference is
an uninterrupted run one row at a time; the killed runs batch rows (refilling slots, finishing
out of order) and must write the same tokens."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from specrt.runtime import GenerationConfig, SpeculativeGenerator, StructuredOutput

REPO = Path(__file__).resolve().parents[1]
WORDS = ["Simple", "is", "better", "than", "def", "fibonacci(n):", "for", "i", "in", "range(10)"]


def write_input(path: Path, rows: int = 30) -> list[dict]:
    lines = []
    for i in range(rows):
        prompt = " ".join(WORDS[i % 10 : i % 10 + 1 + i % 4])
        lines.append({"id": f"row-{i}", "prompt": prompt, "max_new_tokens": 8 + i % 9})
    lines[7] = {"id": "too-long", "prompt": "Simple is better than complex. " * 6}
    lines[12] = {"id": "bad-parameter", "prompt": "a", "top_p": 0}
    lines[15]["stop"] = ["e", "x"]
    text = [json.dumps(line) for line in lines]
    text.insert(20, '{"id": "broken", "prompt": ')  # a malformed line in the middle
    text.append(
        json.dumps({"custom_id": "openai", "body": {"prompt": "for i in", "max_tokens": 5}})
    )
    raw = [line.encode() for line in text]
    raw.insert(26, '{"id": "latin-1", "prompt": "caf\u00e9"}'.encode("latin-1"))  # not UTF-8
    path.write_bytes(b"\n".join(raw) + b"\n")
    return lines


def command(bundle: Path, input_path: Path, output: Path, *extra) -> list[str]:
    args = ["batch", "--bundle", str(bundle), "--input", str(input_path), "--output", str(output)]
    return [sys.executable, "-m", "specrt.cli", *args, "--ignore-eos", "--threads", "1", *extra]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def results(output: Path) -> dict[str, dict]:
    records = [json.loads(line) for line in output.read_text().splitlines()]
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)), "a row was written twice"
    return {r["id"]: {k: v for k, v in r.items() if k != "stats"} for r in records}


@pytest.fixture(scope="module")
def reference(llama_bundle, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    write_input(root / "in.jsonl")
    done = run(
        command(
            llama_bundle,
            root / "in.jsonl",
            root / "out.jsonl",
            "--summary",
            root / "summary.json",
            "--batch-size",
            "1",
        )
    )
    assert done.returncode == 1, done.stderr  # some rows failed, on purpose
    summary = json.loads((root / "summary.json").read_text())
    return root, results(root / "out.jsonl"), summary, done.stderr


def test_bad_rows_become_error_records(reference):
    _, records, summary, done_stderr = reference
    assert len(records) == 33
    for row_id in ("too-long", "bad-parameter", "line 21", "line 27"):
        assert "error" in records[row_id] and "text" not in records[row_id], row_id
    assert "at most 128 positions fit" in records["too-long"]["error"]["message"]
    assert "top_p=0" in records["bad-parameter"]["error"]["message"]
    assert (
        records["openai"]["finish_reason"] == "length" and len(records["openai"]["token_ids"]) == 5
    )
    assert len(records["row-3"]["token_ids"]) == 8 + 3 % 9
    assert "e" not in records["row-15"]["text"] and "x" not in records["row-15"]["text"]
    assert "not UTF-8 text (byte 0xe9" in records["line 27"]["error"]["message"]
    assert summary["rows"] == 33 and summary["ok"] == 29 and summary["failed"] == 4
    assert summary["skipped"] == 0 and summary["new_tokens"] > 0 and summary["batch_size"] == 1
    assert 0 < summary["cache_bytes"] <= summary["cache_bytes_per_row"]  # one row, grown as needed
    assert "33 rows: 29 ok" in done_stderr and "1 row per call" in done_stderr


def test_stdin_to_stdout_and_devices(llama_bundle, reference, tmp_path):
    """``--input -`` reads stdin (spooled: the ids are checked first), ``--output -`` writes
    the records to stdout and the summary to stderr; a full device fails with one line
    instead of hanging (an output that cannot be read back is not read for resuming), and a
    device as input is refused."""
    root, expected, _, _ = reference
    cmd = command(llama_bundle, Path("-"), Path("-"), "--batch-size", "4")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        cmd, input=(root / "in.jsonl").read_bytes(), capture_output=True, env=env, timeout=300,
    )  # fmt: skip
    done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 1, done.stderr  # the bad rows, on purpose
    streamed = tmp_path / "streamed.jsonl"
    streamed.write_text(done.stdout)
    assert results(streamed) == expected
    assert "33 rows: 29 ok, 4 failed" in done.stderr and "4 rows per call" in done.stderr
    full = run(command(llama_bundle, root / "in.jsonl", Path("/dev/full")))
    lines = full.stderr.strip().splitlines()  # the cache's size, said first, then the error
    assert full.returncode == 1 and lines[0].startswith("specrt batch: KV cache"), full.stderr
    full_disk = "Error: No space left on device (free some space, or write somewhere else)"
    assert lines[1:] == [full_disk], full.stderr
    summary = run(
        command(llama_bundle, root / "in.jsonl", tmp_path / "out.jsonl", "--summary", tmp_path)
    )
    assert (
        summary.returncode == 2
        and "--summary" in summary.stderr
        and "is a directory" in summary.stderr
    )
    assert not (tmp_path / "out.jsonl").exists()  # found before any work
    device = run(command(llama_bundle, Path("/dev/zero"), tmp_path / "out.jsonl"))
    assert device.returncode != 0 and "Traceback" not in device.stderr
    assert "/dev/zero is a device, not a JSONL file" in device.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_sigkill_at_any_point_then_rerun_loses_nothing(llama_bundle, reference, tmp_path):
    root, expected, _, _ = reference
    input_path, output = root / "in.jsonl", tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    alive_at_kill = []
    # Early kill points: batched rows are written in bursts, and a late one could find the job
    # already done.
    for lines_before_kill, batch in ((0, 4), (2, 4), (5, 8), (9, 3)):
        process = subprocess.Popen(
            command(llama_bundle, input_path, output, "--batch-size", str(batch)),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            written = output.read_text().count("\n") if output.exists() else 0
            if written >= lines_before_kill:
                break
            time.sleep(0.01)
        alive_at_kill.append(process.poll() is None)
        process.send_signal(signal.SIGKILL)
        process.wait()
    # a line torn by a crash mid-write: detected, cut off, its row done again
    with open(output, "a") as handle:
        handle.write('{"id": "row-29", "text": "half a rec')
    done = run(command(llama_bundle, input_path, output, "--summary", tmp_path / "s.json"))
    assert done.returncode == 1, done.stderr
    assert results(output) == expected  # every id exactly once, the same tokens
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["skipped"] > 0 and summary["ok"] + summary["failed"] + summary["skipped"] == 33
    assert summary["failed"] + summary["skipped_errors"] == 4
    assert all(alive_at_kill)  # every kill hit a running job
    assert summary["ok"] > 0  # the kills did leave rows undone
    again = run(command(llama_bundle, input_path, output))
    assert again.returncode == 1  # the output still holds the three error records
    assert "0 ok, 0 failed, 33 already done (4 of them errors)" in again.stderr
    assert "are errors are not run again: delete those lines to run them again" in again.stderr


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_stops_the_job_with_one_line_and_a_rerun_goes_on(
    llama_bundle, reference, tmp_path, signum, status
):
    """SIGINT (Ctrl-C) or SIGTERM mid-job, reading stdin: exit 130 / 143 with one line saying
    how to go on, the rows written so far kept, the temporary copy of stdin removed; the same
    command again finishes the job, every id once, the same tokens."""
    root, expected, _, _ = reference
    input_path, output = root / "in.jsonl", tmp_path / "out.jsonl"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(scratch)}
    process = subprocess.Popen(
        command(llama_bundle, Path("-"), output, "--batch-size", "2"),
        env=env,
        stdin=open(input_path, "rb"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if output.exists() and output.read_text().count("\n") >= 3:
            break
        time.sleep(0.01)
    assert process.poll() is None, "the job ended before it could be interrupted"
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == status, stderr
    assert "interrupted: the rows finished so far are in" in stderr and "Traceback" not in stderr
    assert 3 <= len(results(output)) < 33
    assert not list(scratch.glob("specrt-input-*"))  # the copy of stdin
    done = run(command(llama_bundle, input_path, output))
    assert done.returncode == 1, done.stderr  # the bad rows, on purpose
    assert results(output) == expected


def test_a_second_job_on_the_same_output_is_refused_while_the_first_runs(llama_bundle, tmp_path):
    """A rerun started while the first job still runs (two terminals, a restarted pod beside
    the old one) read the same ids as done and ran the rest again: rows written twice. The
    output is now the first job's until it ends (a kill -9 lets go of it too)."""
    input_path, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": i, "prompt": WORDS[i % 10], "max_new_tokens": 100} for i in range(3000)]
    input_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.Popen(
        command(llama_bundle, input_path, output, "--batch-size", "1"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while first.poll() is None and not (output.exists() and output.read_text().count("\n")):
        assert time.monotonic() < deadline, "the first job wrote nothing"
        time.sleep(0.01)
    # Refused before a model loads: here there is none to load
    second = run(command(tmp_path / "no-bundle", input_path, output))
    assert first.poll() is None, "the first job ended before the second could be refused"
    assert second.returncode == 1 and second.stderr.strip().splitlines()[-1] == (
        f"Error: another specrt batch is writing {output}; wait for it to finish (or stop it), "
        "then run this again to go on from where it is"
    ), second.stderr
    first.kill()  # however the holder ends, the output is free again
    first.communicate(timeout=60)
    few = tmp_path / "few.jsonl"  # (the 3000 rows' rest would take a while)
    few.write_text("".join(json.dumps(row) + "\n" for row in rows[:40]))
    done = run(command(llama_bundle, few, output))
    assert done.returncode == 0, done.stderr
    assert set(range(40)) <= set(results(output))  # and no id twice (`results` checks)


def test_rows_appended_while_a_job_runs_wait_for_the_next_run(llama_bundle, tmp_path):
    """Rows appended to --input while the job ran were taken: an id already in the file was
    written twice ("300 rows: 302 ok"). The job reads its input as it was when it started;
    the rerun refuses the duplicate id, and once it is mended runs the appended row alone."""
    input_path, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": i, "prompt": WORDS[i % 10], "max_new_tokens": 8} for i in range(6000)]
    input_path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    job = subprocess.Popen(
        command(llama_bundle, input_path, output, "--batch-size", "1"),
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while job.poll() is None and not (output.exists() and output.read_text().count("\n")):
        assert time.monotonic() < deadline, "the job wrote nothing"
        time.sleep(0.01)
    appended = [{"id": 5, "prompt": "again"}, {"id": "new", "prompt": "Simple is"}]
    with open(input_path, "a") as handle:
        handle.write("".join(json.dumps(row) + "\n" for row in appended))
    assert job.poll() is None, "the job ended before rows could be appended"
    _, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, stderr
    assert "6000 rows: 6000 ok" in stderr
    assert sorted(results(output)) == list(range(6000))  # each once (`results`), none more

    rerun = run(command(llama_bundle, input_path, output))
    assert rerun.returncode == 1 and "id 5 appears twice" in rerun.stderr
    assert "Traceback" not in rerun.stderr
    lines = input_path.read_text().splitlines(keepends=True)
    input_path.write_text("".join(lines[:-2] + lines[-1:]))  # the duplicate removed
    rerun = run(command(llama_bundle, input_path, output))
    assert rerun.returncode == 0, rerun.stderr
    assert "6001 rows: 1 ok, 0 failed, 6000 already done" in rerun.stderr
    assert sorted(results(output), key=str) == sorted([*range(6000), "new"], key=str)


def test_duplicate_ids_are_refused_before_any_work(llama_bundle, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(
        '{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b"}\n{"id": "1", "prompt": "c"}\n'
    )
    done = run(command(llama_bundle, path, tmp_path / "out.jsonl"))
    assert done.returncode == 1 and "id '1' appears twice" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out.jsonl").exists()


def test_an_input_in_utf16_is_refused_before_any_work(llama_bundle, tmp_path):
    """Every line of a UTF-16 file would fail alone: one line says what to do instead."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 1, "prompt": "a"}\n', encoding="utf-16")
    done = run(command(llama_bundle, path, tmp_path / "out.jsonl"))
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"Error: {path} is UTF-16 text; JSON Lines are UTF-8: save the file as UTF-8"
    ]
    assert not (tmp_path / "out.jsonl").exists()


def test_an_output_that_is_not_ours_is_left_alone(llama_bundle, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 1, "prompt": "a"}\n')
    output = tmp_path / "notes.jsonl"
    output.write_text("my notes\nmore notes\n")
    done = run(command(llama_bundle, path, output))
    assert done.returncode == 1 and "is not a result of specrt batch" in done.stderr
    assert output.read_text() == "my notes\nmore notes\n"
    done = run(command(llama_bundle, path, path))
    assert done.returncode == 2 and "must not be the --input" in done.stderr
    with open(output, "ab") as stdout:  # `--output - >> notes.jsonl`: named as stdout
        done = subprocess.run(command(llama_bundle, path, Path("-")), stdout=stdout, stderr=-1)
    assert done.returncode == 1 and b"standard output (--output -) is a file" in done.stderr
    assert output.read_text() == "my notes\nmore notes\n"


@pytest.mark.parametrize(
    "content",
    [
        "a note without its newline",  # read as a line torn by a crash, it was cut off
        '{"config": 1, "secret": "keep me"}',  # JSON, but not a record of ours
        '{"id": "p1", "text": "x"}\nmy notes',
        '{"id": "a", "prompt": "the input copied"}\n{"id": "b", "prompt": "b"}\n',
        # Begins as a record does, but whole and not one: it used to be cut off as torn
        '{"id": 7, "note": "my own data, not a result"}',
    ],
)
def test_an_output_of_other_lines_is_never_cut_or_taken_for_results(
    llama_bundle, tmp_path, content
):
    """Only a file of result records (its last line possibly torn mid-record) is resumed;
    anything else is refused whole, with or without a newline at its end."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "prompt": "a"}\n')
    output = tmp_path / "out.txt"
    output.write_text(content)
    done = run(command(llama_bundle, path, output))
    assert done.returncode == 1 and "is not a result of specrt batch" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert output.read_text() == content


def test_the_summary_and_output_paths_are_checked_before_any_work(llama_bundle, tmp_path):
    path = tmp_path / "in.jsonl"
    text = '{"id": "a", "prompt": "a"}\n'
    path.write_text(text)
    output = tmp_path / "out.jsonl"
    linked = tmp_path / "linked.jsonl"
    os.link(path, linked)  # a hard link: the same file under another name
    note = tmp_path / "note.txt"
    note.write_text("mine\n")
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop)
    cases = [
        (command(llama_bundle, path, loop), "--output " + str(loop) + " is a loop of symbolic"),
        (command(llama_bundle, path, linked), "--output must not be the --input file"),
        (command(llama_bundle, path, output, "--summary", path), "--summary must not be"),
        (command(llama_bundle, path, output, "--summary", linked), "--summary must not be"),
        (command(llama_bundle, path, output, "--summary", output), "--summary must not be"),
        (command(llama_bundle, path, output, "--summary", tmp_path), "is a directory"),
        (command(llama_bundle, path, output, "--summary", note / "s.json"), "is a file, not"),
        (command(llama_bundle, path, note / "o.jsonl"), "is a file, not a folder"),
        (command(llama_bundle, path, "-", "--summary", "-"), "would both go to stdout"),
        # where no file can be made, even by root (whom os.access lets write anywhere)
        (command(llama_bundle, path, output, "--summary", "/proc/s.json"), "cannot write in"),
    ]
    for cmd, message in cases:
        done = run(cmd)
        assert done.returncode == 2 and message in done.stderr, (cmd, done.stderr)
        assert "Traceback" not in done.stderr
    assert path.read_text() == text and note.read_text() == "mine\n"
    assert not output.exists()
    done = run(command(llama_bundle, path, output, "--summary", "-"))  # the summary to stdout
    assert done.returncode == 0 and json.loads(done.stdout)["ok"] == 1


def test_a_seeded_job_gives_each_row_its_own_stream(llama_bundle, tmp_path):
    """With --seed, every row samples from a stream keyed by (seed, id): rows with the same
    prompt differ, and a rerun (or a resumed job) gives the same tokens per id."""
    path = tmp_path / "in.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"r{i}", "prompt": "Simple is"}) + "\n" for i in range(6))
    )
    sampled = ["--temperature", "1", "--seed", "7", "--max-new-tokens", "12"]
    run(command(llama_bundle, path, tmp_path / "a.jsonl", *sampled))
    first = results(tmp_path / "a.jsonl")
    assert len({tuple(r["token_ids"]) for r in first.values()}) > 1  # not one stream for all
    reordered = tmp_path / "reordered.jsonl"
    reordered.write_text("".join(reversed(path.read_text().splitlines(keepends=True))))
    run(command(llama_bundle, reordered, tmp_path / "b.jsonl", *sampled))
    assert results(tmp_path / "b.jsonl") == first  # the same tokens per id, whatever the order


def test_a_null_setting_is_the_default_and_unknown_fields_name_the_lines_own_form():
    """As an OpenAI request reads null; an OpenAI batch line is told its own field names."""
    from specrt.jobs.rows import row_from_item

    row = row_from_item({"id": 1, "prompt": "a", "temperature": None, "seed": 3}, "line 1")
    assert row.error is None and row.options == {"seed": 3}
    line = {"custom_id": "c", "body": {"prompt": "a", "colour": 2, "max_tokens": 2}}
    row = row_from_item(line, "line 2")
    assert "unknown field(s) ['colour']" in row.error and "max_new_tokens" not in row.error
    line = {"custom_id": "c", "body": {"prompt": "a", "max_tokens": 0}}
    assert row_from_item(line, "line 3").error == "max_tokens=0: use an integer >= 1"


def test_our_lines_take_openai_s_max_tokens_as_max_new_tokens():
    """A line written for OpenAI's API says max_tokens: it was refused as an unknown field.
    (Our lines take ``structured_output`` as `GenerationConfig` does.)"""
    from specrt.jobs.rows import row_from_item

    row = row_from_item({"id": 1, "prompt": "a", "max_tokens": 5}, "line 1")
    assert row.error is None and row.options == {"max_new_tokens": 5}
    row = row_from_item({"id": 3, "prompt": "a", "structured_output": {"regex": "a+"}}, "line 3")
    assert row.error is None and row.options == {"structured_output": {"regex": "a+"}}
    row = row_from_item({"id": 2, "prompt": "a", "max_tokens": 5, "max_new_tokens": 5}, "line 2")
    assert row.error == 'a line gives "max_new_tokens" or "max_tokens" (its OpenAI name), not both'
    assert row.id == 2


@pytest.mark.parametrize(
    "line, options, prompt",
    [
        # what clients send at their off values, as `specrt serve` takes them (were refused)
        ({"prompt": "a", "n": 1, "user": "u", "stream": False, "logprobs": None, "echo": False,
          "frequency_penalty": 0, "presence_penalty": 0.0, "best_of": 1, "suffix": None,
          "response_format": {"type": "text"}, "store": False, "metadata": {"k": "v"}},
         {"frequency_penalty": 0, "presence_penalty": 0.0}, "a"),  # (taken: off, as given)
        ({"prompt": "a", "top_k": 5, "max_tokens": 3}, {"top_k": 5, "max_new_tokens": 3}, "a"),
        ({"prompt": ["a"]}, {}, "a"),  # one prompt in a list, as OpenAI takes it
        ({"prompt": [5, 6, 7]}, {}, [5, 6, 7]),  # token ids
        ({"prompt": "a", "truncate_prompt_tokens": 8}, {"truncate_prompt_tokens": 8}, "a"),
        ({"prompt": "a", "priority": 0}, {}, "a"),  # vLLM's default: the file's order
        # structured output: vLLM's and OpenAI's fields
        ({"prompt": "a", "guided_regex": "a+"},
         {"structured_output": StructuredOutput(regex="a+")}, "a"),
        ({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object"}}}},
         {"structured_output": StructuredOutput(json={"type": "object"})}, "a"),
    ],
)  # fmt: skip
def test_openai_lines_take_what_specrt_serve_takes(line, options, prompt):
    from specrt.jobs.rows import row_from_item

    row = row_from_item({"custom_id": "c", "url": "/v1/completions", "body": line}, "line 1")
    assert row.error is None and row.options == options and row.prompt == prompt
    assert row.openai and row.id == "c"


@pytest.mark.parametrize(
    "line, message",
    [
        ({"url": "/v1/embeddings", "body": {"input": "a"}},
         "url '/v1/embeddings': specrt batch answers /v1/completions and /v1/chat/completions"),
        ({"method": "GET", "body": {"prompt": "a"}}, "method 'GET'"),
        ({"body": {"prompt": "a", "stream": True}}, "a batch line cannot stream"),
        ({"body": {"prompt": "a", "priority": 2}},
         "priority=2: a batch job runs its lines in the file's order"),
        ({"body": {"prompt": "a", "priority": True}}, "priority=true: a batch job runs"),
        ({"body": {"prompt": "a", "n": 129}}, "n=129: use an integer from 1 to 128"),
        ({"body": {"prompt": "a", "echo": 1}}, "echo=1: use true or false"),
        ({"body": {"prompt": ["a", "b"]}}, "prompt is a list of 2 prompts: a batch line answers"),
        ({"body": {"prompt": [1, "a"]}}, "prompt must be a string, a list of token ids, or"),
        # the url decides the kind of request (the body's keys decided, whatever the url)
        ({"url": "/v1/chat/completions", "body": {"prompt": "a"}},
         "a chat request gives messages, not a prompt"),
        ({"url": "/v1/completions", "body": {"messages": []}},
         "a completion request gives a prompt, not messages"),
        ({"body": "{\"prompt\": \"a\"}"}, '"body" must be an object'),
        ({"body": {"prompt": "a", "guided_regex": "[a-"}},
         "guided_regex: the structured output does not compile"),
    ],
)  # fmt: skip
def test_openai_lines_specrt_cannot_answer_are_told_why_under_their_own_id(line, message):
    from specrt.jobs.rows import row_from_item

    row = row_from_item({"custom_id": "c", **line}, "line 9")
    assert message in row.error and row.id == "c" and row.named and row.openai


def test_an_openai_line_without_its_custom_id_is_told_so():
    from specrt.jobs.rows import row_from_item

    line = {"method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}}
    row = row_from_item(line, "line 3")
    assert row.error == 'an OpenAI batch line needs a "custom_id"' and row.id == "line 3"


def test_a_repeated_key_keeps_an_openai_line_an_openai_line():
    """One such line switched a whole OpenAI file's output to specrt's records."""
    from specrt.jobs.rows import parse_row

    line = '{"custom_id": "d", "body": {"prompt": "a", "max_tokens": 3, "max_tokens": 4}}'
    row = parse_row(line, "line 1")
    assert row.openai and row.id == "d" and "appears twice" in row.error


TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def chat_bundle(llama_bundle: Path, tmp_path: Path, template: str = TEMPLATE) -> Path:
    """A copy of the bundle whose tokenizer has a chat template."""
    bundle = tmp_path / "chat"
    shutil.copytree(llama_bundle, bundle)
    config_path = bundle / "tokenizer" / "tokenizer_config.json"
    settings = json.loads(config_path.read_text())
    settings["chat_template"] = template
    config_path.write_text(json.dumps(settings))
    return bundle


def test_chat_lines_are_rendered_with_the_bundles_chat_template(llama_bundle, tmp_path):
    """OpenAI batch lines for /v1/chat/completions (vLLM's run-batch takes them) and our own
    lines with "messages": rendered as `specrt serve` renders them, the same tokens as the
    rendered prompt decoded alone (they were refused as unknown fields); a bundle without a
    template, and malformed messages, give the row an error."""
    bundle = chat_bundle(llama_bundle, tmp_path)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f"}]
    lines = [
        {"custom_id": "oai", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "x", "messages": messages, "max_completion_tokens": 7}},
        {"id": "own", "messages": messages, "max_new_tokens": 7},
        {"id": "parts", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"id": "both", "prompt": "a", "messages": messages},
    ]  # fmt: skip
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = run(command(bundle, path, tmp_path / "out.jsonl"))
    assert done.returncode == 1, done.stderr  # the two bad rows
    got = results(tmp_path / "out.jsonl")
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    rendered = "<system>be brief\n<user>def f\n<assistant>"
    ids = generator.tokenizer.encode(rendered, add_special_tokens=False)
    config = GenerationConfig(max_new_tokens=7, num_draft_tokens=0, ignore_eos=True)
    [alone] = generator.generate([ids], config)
    assert got["oai"]["token_ids"] == got["own"]["token_ids"] == alone.token_ids
    assert "only text parts are supported" in got["parts"]["error"]["message"]
    assert 'a "prompt" or chat "messages", not both' in got["both"]["error"]["message"]
    done = run(command(llama_bundle, path, tmp_path / "plain.jsonl"))
    got = results(tmp_path / "plain.jsonl")
    assert 'has no chat template: give a "prompt"' in got["own"]["error"]["message"]


def test_a_chat_template_that_raises_fails_its_row_alone_and_generate_says_one_line(
    llama_bundle, tmp_path
):
    """A template is code: one raising a plain Python error (here a TypeError, for one
    message) fails the rows it cannot render, in one line each, not the job (a traceback ended
    it before any row was written), and `specrt generate --chat` says so in one line."""
    loop = "{% for m in messages %}"
    raises = TEMPLATE.replace(
        loop, loop + "{% if m.content == 'boom' %}{{ m.content + 1 }}{% endif %}"
    )
    bundle = chat_bundle(llama_bundle, tmp_path, raises)
    lines = [
        {"id": "boom", "messages": [{"role": "user", "content": "boom"}], "max_new_tokens": 3},
        {"id": "fine", "messages": [{"role": "user", "content": "def f"}], "max_new_tokens": 3},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = run(command(bundle, path, tmp_path / "out.jsonl"))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    got = results(tmp_path / "out.jsonl")
    assert "cannot render these messages: TypeError" in got["boom"]["error"]["message"]
    assert len(got["fine"]["token_ids"]) == 3
    args = ["generate", "--bundle", str(bundle), "--chat", "--prompt", "boom"]
    said = run([sys.executable, "-m", "specrt.cli", *args, "--max-new-tokens", "2"])
    assert said.returncode != 0 and "Traceback" not in said.stderr + said.stdout
    assert "cannot render these messages: TypeError" in said.stderr + said.stdout


def test_openai_batch_files_get_openai_batch_output(llama_bundle, tmp_path):
    """An input of OpenAI batch-file lines gets OpenAI's batch output lines (custom_id,
    response.status_code, response.body a completion or chat completion the official client
    parses; a bad row's error in the body and in "error"), with the tokens our own records
    give; a torn last line is redone on a rerun, and records of the other format are refused
    with the option to use. An input that mixes in our lines keeps our records."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    bundle = chat_bundle(llama_bundle, tmp_path)
    messages = [{"role": "user", "content": "def f"}]
    lines = [
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"model": "x", "prompt": "for i in", "max_tokens": 6}},
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "x", "messages": messages, "max_completion_tokens": 7}},
        {"custom_id": "bad", "body": {"prompt": "a", "max_tokens": -1}},
        {"custom_id": "last", "body": {"prompt": "Simple is", "max_tokens": 5}},
    ]  # fmt: skip
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ours = tmp_path / "ours.jsonl"
    assert run(command(bundle, path, ours, "--output-format", "specrt")).returncode == 1
    expected = results(ours)
    output = tmp_path / "out.jsonl"
    done = run(command(bundle, path, output))
    assert done.returncode == 1 and "written as OpenAI batch output" in done.stderr, done.stderr
    records = {r["custom_id"]: r for r in map(json.loads, output.read_text().splitlines())}
    assert sorted(records) == ["bad", "chat", "last", "text"]
    for name in ("text", "last"):
        response = records[name]["response"]
        assert records[name]["error"] is None and response["status_code"] == 200
        body = Completion.model_validate(response["body"])
        assert body.model == "chat" and body.choices[0].text == expected[name]["text"]
        assert body.choices[0].finish_reason == expected[name]["finish_reason"] == "length"
        assert body.usage.completion_tokens == len(expected[name]["token_ids"])
    chat = ChatCompletion.model_validate(records["chat"]["response"]["body"])
    assert chat.choices[0].message.content == expected["chat"]["text"]
    assert chat.choices[0].message.role == "assistant"
    bad = records["bad"]
    assert bad["response"]["status_code"] == 400
    assert bad["error"]["message"] == bad["response"]["body"]["error"]["message"]
    assert bad["error"]["message"] == "max_tokens=-1: use an integer >= 1"  # its own name

    # A crash mid-write: the torn line's row runs again, the others are not written twice
    data = output.read_bytes()
    output.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) + 30])
    torn = json.loads(data.splitlines()[-1])["custom_id"]
    done = run(command(bundle, path, output))
    assert done.returncode == 1 and "3 already done" in done.stderr, done.stderr
    again = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in again) == ["bad", "chat", "last", "text"]
    assert again[-1]["custom_id"] == torn
    before = output.read_bytes()
    refused = run(command(bundle, path, output, "--output-format", "specrt"))
    assert refused.returncode == 1 and output.read_bytes() == before
    assert refused.stderr.strip().splitlines()[-1] == (
        f"Error: {output} holds records of --output-format openai (line 1), not specrt: rerun "
        "with --output-format openai to go on with it, or give another --output"
    )
    refused = run(command(bundle, path, ours, "--output-format", "openai"))
    assert "holds records of --output-format specrt" in refused.stderr

    path.write_text(path.read_text() + json.dumps({"id": "own", "prompt": "a"}) + "\n")
    mixed = tmp_path / "mixed.jsonl"
    run(command(bundle, path, mixed))
    assert results(mixed)["text"]["text"] == expected["text"]["text"]


def test_openai_lines_of_several_choices_get_them_all(llama_bundle, tmp_path):
    """An OpenAI line's ``n``: its choices run as rows of their own (choice i drawing from the
    stream (seed, i), as `generate`'s row i and `specrt serve`'s choice i do) and come back in
    one line once all are done; our records keep the first's text where a record of one has it
    and every choice under "choices". A Ray Data row of several choices is told to send one
    row per choice."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    from specrt.jobs.batch import make_request
    from specrt.jobs.rows import row_from_item

    bundle = chat_bundle(llama_bundle, tmp_path)
    sampled = {"temperature": 1.0, "seed": 7, "max_tokens": 6}
    lines = [
        {"custom_id": "text", "body": {"prompt": "for i in", "n": 3, **sampled}},
        {"custom_id": "chat", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "def f"}], "n": 2, "max_tokens": 5}},
        {"custom_id": "one", "body": {"prompt": "Simple is", "max_tokens": 4}},
    ]  # fmt: skip
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output, ours = tmp_path / "out.jsonl", tmp_path / "ours.jsonl"
    assert run(command(bundle, path, output)).returncode == 0
    assert run(command(bundle, path, ours, "--output-format", "specrt")).returncode == 0
    records = {r["custom_id"]: r for r in map(json.loads, output.read_text().splitlines())}
    assert sorted(records) == ["chat", "one", "text"]
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    config = GenerationConfig(max_new_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    expected = generator.generate(["for i in"] * 3, config)
    text = Completion.model_validate(records["text"]["response"]["body"])
    assert [c.index for c in text.choices] == [0, 1, 2]
    assert [c.text for c in text.choices] == [r.text for r in expected]
    assert len({c.text for c in text.choices}) > 1  # sampled: the choices differ
    assert text.usage.prompt_tokens == len(generator.encode_prompts(["for i in"])[0])
    assert text.usage.completion_tokens == sum(len(r.token_ids) for r in expected)
    chat = ChatCompletion.model_validate(records["chat"]["response"]["body"])
    assert len(chat.choices) == 2 and chat.choices[0].message == chat.choices[1].message
    assert len(Completion.model_validate(records["one"]["response"]["body"]).choices) == 1
    own = results(ours)
    assert [c["text"] for c in own["text"]["choices"]] == [r.text for r in expected]
    assert own["text"]["text"] == expected[0].text and "choices" not in own["one"]
    row = row_from_item(lines[0], "line 1")
    message = make_request(generator, row, GenerationConfig())["error"]["message"]
    assert message == "n=3: only specrt batch answers several choices; send one row per choice"


def test_rows_asking_for_logprobs_get_them_as_specrt_serve_writes_them(llama_bundle, tmp_path):
    """A line's ``logprobs`` (a completion's N, a chat's ``logprobs: true``, our rows' own
    ``logprobs``): each new token's log-probability and its N most likely alternatives, the
    values `generate` gives, in OpenAI's shape (every choice of an ``n`` line) or in our
    records; a Ray Data row asking on its own is told to give them to the predictor."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    from specrt.jobs.batch import make_request
    from specrt.jobs.rows import row_from_item

    bundle = chat_bundle(llama_bundle, tmp_path)
    sampled = {"temperature": 1.0, "seed": 7, "max_tokens": 6, "logprobs": 2}
    lines = [
        {"custom_id": "text", "body": {"prompt": "for i in", "n": 2, **sampled}},
        {"custom_id": "chat", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "def f"}], "max_tokens": 5,
                  "logprobs": True, "top_logprobs": 1}},
        {"custom_id": "echo", "body": {"prompt": "for i in", "max_tokens": 3, "echo": True,
                                       "logprobs": 1}},
        {"custom_id": "scored", "body": {"prompt": "for i in", "max_tokens": 0, "echo": True,
                                         "logprobs": 0}},
        {"custom_id": "plain", "body": {"prompt": "for i in", "max_tokens": 4, "logprobs": 2,
                                        "temperature": 0}},
        {"custom_id": "by id", "body": {"prompt": "for i in", "max_tokens": 4, "logprobs": 2,
                                        "temperature": 0, "return_token_ids": True,
                                        "return_tokens_as_token_ids": True}},
    ]  # fmt: skip
    path, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert run(command(bundle, path, output)).returncode == 0
    records = {r["custom_id"]: r for r in map(json.loads, output.read_text().splitlines())}
    generator = SpeculativeGenerator.from_bundle(bundle, threads=1)
    config = GenerationConfig(max_new_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    expected = generator.generate(["for i in"] * 2, replace(config, logprobs=2))
    text = Completion.model_validate(records["text"]["response"]["body"])
    for choice, result in zip(text.choices, expected, strict=True):
        assert "".join(choice.logprobs.tokens) == choice.text == result.text
        values = [e.logprob for e in result.logprobs]
        assert choice.logprobs.token_logprobs == pytest.approx(values, abs=1e-4)
        assert [len(top) for top in choice.logprobs.top_logprobs] == [2] * len(values)
    chat = ChatCompletion.model_validate(records["chat"]["response"]["body"])
    content = chat.choices[0].logprobs.content
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert len(content) == chat.usage.completion_tokens and len(content[0].top_logprobs) == 1
    # echo: the prompt and its tokens' entries (the first's None) before the answer's, as
    # `specrt serve` answers it; max_tokens 0: the prompt alone
    ids = generator.encode_prompts(["for i in"])[0]
    [scored] = generator.generate(["for i in"], GenerationConfig(max_new_tokens=1,
                                                                  prompt_logprobs=0))  # fmt: skip
    expected_prompt = [e.logprob for e in scored.prompt_logprobs[1:]]
    # (null for the first token, as OpenAI and vLLM answer; the openai package's type says a
    # number, so these are read as JSON)
    echo = records["echo"]["response"]["body"]["choices"][0]
    assert echo["text"].startswith("for i in") and len(echo["logprobs"]["tokens"]) == len(ids) + 3
    assert echo["logprobs"]["token_logprobs"][0] is None
    assert echo["logprobs"]["top_logprobs"][0] is None
    got = echo["logprobs"]["token_logprobs"][1 : len(ids)]
    assert got == pytest.approx(expected_prompt, abs=1e-4)
    only = records["scored"]["response"]["body"]
    assert only["choices"][0]["text"] == "for i in" and only["usage"]["completion_tokens"] == 0
    got = only["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert got == pytest.approx(expected_prompt, abs=1e-4)
    # vLLM's return_token_ids and return_tokens_as_token_ids: the ids, and the log-probabilities'
    # tokens named by them ("token_id:N"), the values and text offsets those of the text
    [plain] = records["plain"]["response"]["body"]["choices"]
    [named] = records["by id"]["response"]["body"]["choices"]
    assert named["prompt_token_ids"] == ids and len(named["token_ids"]) == 4
    assert named["text"] == plain["text"] and "token_ids" not in plain
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in named["token_ids"]]
    assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert named["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    for top, words in zip(named["logprobs"]["top_logprobs"], plain["logprobs"]["top_logprobs"]):
        assert set(words.values()) <= set(top.values()) and len(top) == 2  # (texts may repeat)
        assert all(re.fullmatch(r"token_id:\d+", name) for name in top)
    ours, own = tmp_path / "ours.jsonl", tmp_path / "own.jsonl"
    ours.write_text(json.dumps({"id": "own", "prompt": "for i in", "logprobs": 1, **{
        k: v for k, v in sampled.items() if k not in ("logprobs", "max_tokens")},
        "max_new_tokens": 6}) + "\n")  # fmt: skip
    assert run(command(bundle, ours, own)).returncode == 0
    [record] = map(json.loads, own.read_text().splitlines())
    [alone] = generator.generate(["for i in"], replace(config, logprobs=1))
    assert [e["token_id"] for e in record["logprobs"]] == record["token_ids"] == alone.token_ids
    assert [len(e["top"]) for e in record["logprobs"]] == [1] * len(alone.token_ids)
    row = row_from_item(lines[1], "line 2")
    message = make_request(generator, row, GenerationConfig())["error"]["message"]
    assert message.startswith("logprobs: a Ray Data row cannot ask for log-probabilities")


def test_the_summary_counts_the_prompt_tokens_copied(llama_bundle, tmp_path):
    """Rows one after another (batch size 1) whose prompts begin alike copy that beginning
    from the row before: the summary and the last line count the prompt tokens copied, and
    each record says its own (`cached_tokens`)."""
    system = "Simple is better than complex. Flat is better than nested. "
    lines = [{"id": i, "prompt": system + end} for i, end in enumerate(["for i in", "def f"])]
    path, output, summary = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "s.json"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = run(command(llama_bundle, path, output, "--batch-size", "1", "--summary", summary))
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in output.read_text().splitlines()]
    cached = [r["stats"]["cached_tokens"] for r in sorted(records, key=lambda r: r["id"])]
    report = json.loads(summary.read_text())
    assert cached[0] == 0 and cached[1] >= 16 and report["cached_tokens"] == cached[1]
    prompts = sum(r["stats"]["prompt_tokens"] for r in records)
    assert report["prompt_tokens"] == prompts
    assert f"; {cached[1]} of {prompts} prompt tokens copied from a beginning" in done.stderr


def test_resuming_reads_the_output_line_by_line(tmp_path):
    """A resumed job holds the ids done, not the output file: 48 MB of results read back grew
    the process by 104 MiB before (the file, then its lines), now by the ids alone."""
    output = tmp_path / "out.jsonl"
    record = {"text": "x" * 400, "token_ids": list(range(128)), "finish_reason": "length"}
    with open(output, "w") as handle:
        for i in range(50_000):
            handle.write(json.dumps({"id": f"row-{i}", **record, "stats": {}}) + "\n")
    # The process's own peak (VmHWM): ru_maxrss would carry the forking parent's over exec.
    script = (
        "import sys; from pathlib import Path\n"
        "from specrt.jobs.output import done_ids\n"
        "def peak():\n"
        "    status = Path('/proc/self/status').read_text().split('VmHWM:')[1]\n"
        "    return int(status.split()[0])\n"
        "before = peak()\n"
        "ids = done_ids(Path(sys.argv[1]))\n"
        "print(len(ids), (peak() - before) // 1024)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script, str(output)], capture_output=True, text=True, env=env
    )
    count, grown_mib = map(int, done.stdout.split())
    assert count == 50_000 and grown_mib < 30, (count, grown_mib, output.stat().st_size >> 20)


def test_lines_an_operator_writes_are_read_as_written(llama_bundle, tmp_path):
    """From an audit: integer ids came back as strings; 1 and "1" were refused as one id
    without saying why, and so was a real id equal to a broken line's placeholder; a gzip file
    was read as lines of bad bytes; a line cut short blamed column 1; a repeated key, a line
    of both forms and a body that is not an object were read silently or misnamed; records of
    ids no longer in the input went unmentioned."""
    import gzip

    path = tmp_path / "in.jsonl"
    path.write_text(
        '{"id": 1, "prompt": "a", "max_new_tokens": 2}\n'
        '{"id": "b", "prompt": "b", "prompt": "c"}\n'
        '{"id": "c", "prompt": "a" \n'
        '{"custom_id": "d", "id": "d", "body": {"prompt": "a"}}\n'
        '{"custom_id": "e", "body": "a prompt"}\n'
    )
    output = tmp_path / "out.jsonl"
    done = run(command(llama_bundle, path, output))
    assert done.returncode == 1, done.stderr  # the bad rows
    records = [json.loads(line) for line in output.read_text().splitlines()]
    by_id = {r["id"]: r for r in records}
    assert 1 in by_id and "text" in by_id[1]  # the id as the line gave it
    assert by_id["b"]["error"]["message"] == "the key 'prompt' appears twice in the line"
    assert "at column 27" in by_id["line 3"]["error"]["message"]  # its end, not 1
    assert "not both" in by_id["line 4"]["error"]["message"]
    assert '"body" must be an object' in by_id["e"]["error"]["message"]  # under its own id

    path.write_text('{"id": 1, "prompt": "a"}\n')  # the broken lines mended away
    done = run(command(llama_bundle, path, output))
    assert done.returncode == 0, done.stderr
    assert "also holds 4 record(s) of ids not in" in done.stderr and "'b'" in done.stderr

    path.write_text('{"id": 1, "prompt": "a"}\n{"id": "1", "prompt": "b"}\n')
    done = run(command(llama_bundle, path, tmp_path / "o2.jsonl"))
    assert done.returncode == 1 and "ids are compared as text: 1 and '1' are one id" in done.stderr
    path.write_text('not json\n{"id": "line 1", "prompt": "b"}\n')
    done = run(command(llama_bundle, path, tmp_path / "o3.jsonl"))
    assert done.returncode == 1 and "too broken to read its id is named 'line 1'" in done.stderr
    packed = tmp_path / "in.jsonl.gz"
    packed.write_bytes(gzip.compress(b'{"id": 1, "prompt": "a"}\n'))
    done = run(command(llama_bundle, packed, tmp_path / "o4.jsonl"))
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"Error: {packed} is gzip-compressed; give the JSONL itself, e.g. `gunzip -c {packed} "
        "| specrt batch --input - ...`"
    ]
    assert not (tmp_path / "o4.jsonl").exists()


def test_a_whole_record_without_its_newline_is_kept_and_a_torn_one_redone(llama_bundle, tmp_path):
    """From an audit: a last line without its newline was cut off whenever it began as a
    record does, though whole (a record of an id no longer in the input was lost with it)."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "prompt": "a"}\n{"id": "b", "prompt": "b"}\n')
    output = tmp_path / "out.jsonl"
    old = {"id": "old", "text": "x", "token_ids": [1], "finish_reason": "length", "stats": {}}
    output.write_text(json.dumps(old))  # whole, without its newline
    done = run(command(llama_bundle, path, output, "--max-new-tokens", "2"))
    assert done.returncode == 0, done.stderr
    assert "also holds 1 record(s) of ids not in" in done.stderr and "'old'" in done.stderr
    lines = output.read_text().splitlines()
    assert json.loads(lines[0]) == old and len(lines) == 3  # kept and ended; a and b after it
    a_line = next(line for line in lines if json.loads(line)["id"] == "a")
    kept = [line for line in lines if json.loads(line)["id"] != "a"]
    output.write_text("\n".join(kept) + "\n" + a_line[:25])  # a's record torn mid-write
    done = run(command(llama_bundle, path, output, "--max-new-tokens", "2"))
    assert done.returncode == 0, done.stderr
    assert "1 ok, 0 failed, 1 already done" in done.stderr  # a again, b skipped
    assert sorted(json.loads(line)["id"] for line in output.read_text().splitlines()) == [
        "a",
        "b",
        "old",
    ]


def test_json_beyond_what_python_reads_is_a_bad_row():
    """From an audit: a 5,000-digit number or arrays nested 100,000 deep in one line, and an
    OpenAI line whose url is a list, ended the whole job with a traceback."""
    from specrt.jobs.rows import parse_row

    long_number = parse_row('{"id": ' + "9" * 5001 + ', "prompt": "x"}', "line 1")
    assert long_number.error == "JSON that cannot be read: a number too long"
    assert long_number.id == "line 1" and not long_number.named
    deep = parse_row('{"id": 2, "prompt": "y", "stop": ' + "[" * 100_000 + "]" * 100_000 + "}", "l")
    assert deep.error == "JSON that cannot be read: nested too deeply"
    twice = parse_row('{"id": 3, "s": {"k": 1, "k": 2}, "n": ' + "9" * 5001 + "}", "line 3")
    assert twice.error == "the key 'k' appears twice in the line" and twice.id == "line 3"
    url = parse_row('{"custom_id": "u", "url": ["x"], "body": {"prompt": "hi"}}', "line 4")
    assert url.id == "u" and url.error.startswith("url ['x']: specrt batch answers")


def test_an_id_json_escapes_as_a_lone_surrogate_is_written_and_resumed(llama_bundle, tmp_path):
    """From an audit: such an id (JSON allows "\\ud800") cannot be written as UTF-8: the job
    died at its record, and every rerun again. Its record is written escaped and read back."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "\\ud800", "prompt": "a"}\n{"id": "b", "prompt": "b"}\n')
    output = tmp_path / "out.jsonl"
    done = run(command(llama_bundle, path, output, "--max-new-tokens", "2"))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert '"id": "\\ud800"' in output.read_text()
    assert {json.loads(line)["id"] for line in output.read_text().splitlines()} == {"\ud800", "b"}
    done = run(command(llama_bundle, path, output, "--max-new-tokens", "2"))
    assert done.returncode == 0 and "0 ok, 0 failed, 2 already done" in done.stderr


def test_standard_input_is_named_as_such_and_its_copy_never_outlives_the_job(
    llama_bundle, tmp_path
):
    """From an audit: errors about a piped input named the temporary copy (already removed),
    and a job killed with -9 left that copy of its whole input behind."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(scratch)}
    cmd = command(llama_bundle, Path("-"), tmp_path / "out.jsonl")
    packed = subprocess.run(
        cmd, input=gzip_of(b'{"id": 1, "prompt": "a"}\n'), capture_output=True, env=env
    )
    assert packed.returncode == 1 and packed.stderr.decode().strip().splitlines() == [
        "Error: standard input is gzip-compressed; give the JSONL itself, e.g. `gunzip -c FILE"
        " | specrt batch --input - ...`"
    ]
    rows = "".join(json.dumps({"id": i, "prompt": WORDS[i % 10]}) + "\n" for i in range(400))
    output = tmp_path / "killed.jsonl"
    process = subprocess.Popen(
        command(llama_bundle, Path("-"), output, "--max-new-tokens", "32"),
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    process.stdin.write(rows.encode())
    process.stdin.close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (output.exists() and output.read_text()):
        time.sleep(0.01)
    assert process.poll() is None  # killed while it runs
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert list(scratch.glob("specrt-input-*")) == []  # (onnxruntime leaves its .ses there)


def gzip_of(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data)


def test_a_summary_through_a_link_is_written_where_it_points(llama_bundle, tmp_path):
    """From an audit: a --summary link to a folder not made yet passed the early check, and
    the whole job ran before its summary failed; the folders are made where it points."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "prompt": "a"}\n')
    link = tmp_path / "summary.json"
    link.symlink_to(tmp_path / "nope" / "deeper" / "s.json")
    done = run(command(llama_bundle, path, tmp_path / "out.jsonl", "--summary", link))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "nope" / "deeper" / "s.json").read_text())["ok"] == 1
    assert link.is_symlink()
    # Live links are opened as they are: /dev/stdout and /dev/stderr, links to pipes here,
    # have no path of their own to follow to
    cmd = command(llama_bundle, path, Path("/dev/stdout"), "--summary", "/dev/stderr")
    done = run(cmd)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["id"] == "a" and '"ok": 1' in done.stderr


def test_a_record_line_emptied_by_hand_runs_its_row_again(llama_bundle, tmp_path):
    """From an audit: an output line emptied in an editor (rather than deleted) made the whole
    output "not a result of specrt batch"."""
    path = tmp_path / "in.jsonl"
    path.write_text("".join(f'{{"id": "{i}", "prompt": "{i}"}}\n' for i in "abc"))
    output = tmp_path / "out.jsonl"
    assert run(command(llama_bundle, path, output, "--max-new-tokens", "2")).returncode == 0
    lines = output.read_text().splitlines()
    output.write_text("\n".join(lines[:1] + ["  "] + lines[2:]) + "\n")
    done = run(command(llama_bundle, path, output, "--max-new-tokens", "2"))
    assert done.returncode == 0 and "1 ok, 0 failed, 2 already done" in done.stderr, done.stderr
    ids = [json.loads(line)["id"] for line in output.read_text().splitlines() if line.strip()]
    assert sorted(ids) == ["a", "b", "c"]


def test_null_messages_are_not_given():
    from specrt.jobs.rows import row_from_item

    row = row_from_item({"id": 1, "messages": None}, "line 1")
    assert row.error == 'a line needs a "prompt" string (or chat "messages")'
    row = row_from_item({"id": 1, "prompt": "a", "messages": None}, "line 1")
    assert row.error is None and row.prompt == "a"


def test_input_and_output_are_checked_before_the_model_loads(tmp_path):
    """From an audit: duplicate ids, or an output that is not ours, were refused only once the
    bundle had loaded (minutes for a large model). Here there is no bundle at all: the input's
    and the output's errors come first."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    no_bundle = tmp_path / "no-bundle"
    done = run(command(no_bundle, path, tmp_path / "out.jsonl"))
    assert done.returncode == 1 and "id 1 appears twice" in done.stderr, done.stderr
    path.write_text('{"id": 1, "prompt": "a"}\n')
    output = tmp_path / "notes.txt"
    output.write_text("my notes\n")
    done = run(command(no_bundle, path, output))
    assert done.returncode == 1 and "is not a result of specrt batch" in done.stderr, done.stderr
    assert output.read_text() == "my notes\n"
    done = run(command(no_bundle, path, tmp_path / "out.jsonl"))  # now the bundle's turn
    assert done.returncode != 0 and "no-bundle" in done.stderr and "Traceback" not in done.stderr


def test_a_line_too_long_for_the_context_runs_from_its_last_tokens_where_it_asks(
    llama_bundle, tmp_path
):
    """A line's ``truncate_prompt_tokens`` (vLLM's): its prompt, too long for the context, runs
    from its last N tokens as if they were the prompt; the same line without it is an error
    record, and the job goes on."""
    generator = SpeculativeGenerator.from_bundle(llama_bundle, threads=1)
    text = "Simple is better than complex. " * generator.target.max_positions
    ids = generator.tokenizer.encode(text)
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    [expected] = generator.generate([ids[-25:]], config)
    lines = [
        {"id": "cut", "prompt": text, "max_new_tokens": 6, "truncate_prompt_tokens": 25},
        {"id": "whole", "prompt": text, "max_new_tokens": 6},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = run(command(llama_bundle, tmp_path / "in.jsonl", tmp_path / "out.jsonl"))
    assert done.returncode == 1, done.stderr  # the whole prompt's row failed
    records = results(tmp_path / "out.jsonl")
    assert records["cut"]["token_ids"] == expected.token_ids
    assert "tokens" in records["whole"]["error"]["message"]

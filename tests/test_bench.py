"""The benchmark runs and reports what the issue asks for (no timing is asserted)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specrt.backends import NEED_ARGMAX, Forward
from specrt.bench.costs import step_seconds
from specrt.bench.runner import predicted_speedup
from specrt.cli import main
from tests.conftest import chat_bundle


def bench_lines(script: str, *args: str) -> list[str]:
    """What ``bench/script`` prints, run as a user runs it; it must exit 0."""
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / script
    result = subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


def test_predicted_speedup_formula():
    assert predicted_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)
    assert predicted_speedup(0.5, 2, 0.0) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert predicted_speedup(1.0, 3, 0.1) == pytest.approx(4 / 1.3)
    assert predicted_speedup(0.5, 2, 0.0, verify_cost_ratio=1.25) == pytest.approx(1.75 / 1.25)


def test_step_costs_time_greedy_steps():
    """c and v_K are the cost of greedy steps: the timed calls bring back each row's argmax.
    They asked for the logits, and on a GPU a [tokens, 128256] float32 copy per step inflated
    both; the history before them is a prefill."""

    class Recorder:
        vocab_size, max_positions, length = 100, 64, 0

        def __init__(self) -> None:
            self.calls: list[tuple[str, int, str]] = []

        def reset(self) -> None:
            self.length = 0

        def rollback(self, length: int) -> None:
            self.length = length

        def prefill(self, tokens) -> None:
            self.calls.append(("prefill", len(tokens), ""))
            self.length += len(tokens)

        def forward(self, tokens, keep_last: int = 0, need: str = "logits") -> Forward:
            self.calls.append(("forward", len(tokens), need))
            self.length += len(tokens)
            return Forward(None, argmax=[0] * len(tokens))

    decoder = Recorder()
    assert step_seconds(decoder, context=20, tokens=3, repeats=5) > 0
    assert decoder.calls[0] == ("prefill", 20, "")
    assert decoder.calls[1:] == [("forward", 3, NEED_ARGMAX)] * 8  # 3 warm-up calls + 5 timed


def test_bench_reports_every_contender(llama_bundle, tmp_path):
    args = ["bench", "--bundle", str(llama_bundle), "--prompt", "Simple is", "--prompt", "def f"]
    args += ["--max-new-tokens", "12", "--max-draft-tokens", "2", "--json"]
    args += ["--plot", str(tmp_path / "bench.png")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report["results"]) == {"greedy", "temperature 1"}
    names = set(report["results"]["greedy"])
    assert {"specrt target only", "specrt K=1", "specrt K=2", "specrt adaptive K<=2"} <= names
    assert "specrt heuristic K<=2" in names
    assert {"transformers target only", "transformers assisted"} <= names
    # Drafters without a model, and transformers' own prompt lookup beside them (K capped at
    # the bench's largest K, 2 here).
    assert {"specrt lookup K=2", "specrt hybrid adaptive K<=2"} <= names
    assert "transformers prompt lookup K=2" in names
    k2 = report["results"]["greedy"]["specrt K=2"]
    keys = ["tokens_per_second", "speedup", "alpha", "predicted_speedup", "overhead_fraction"]
    for key in [*keys, "predicted_speedup_measured_verify"]:
        assert key in k2
    assert 0 <= k2["overhead_fraction"] < 1 and 0 <= k2["alpha"] <= 1
    # Matches have no K (the hybrid's run to 24): an alpha over its first K positions was
    # shown beside an acceptance rate it contradicted
    hybrid = report["results"]["greedy"]["specrt hybrid adaptive K<=2"]
    assert "alpha" not in hybrid and 0 <= hybrid["acceptance_rate"] <= 1
    assert report["costs"]["cost_ratio"] > 0
    assert report["results"]["greedy"]["specrt target only"]["speedup"] == 1.0
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_genai_contender_needs_its_environment(llama_bundle, tmp_path):
    """Without the onnxruntime-genai environment the bench says how to make it (exit 1) instead
    of running for minutes first."""
    args = ["bench", "--bundle", str(llama_bundle), "--prompt", "Simple is", "--no-transformers"]
    args += ["--max-new-tokens", "4", "--max-draft-tokens", "1"]
    result = CliRunner().invoke(main, [*args, "--genai-python", str(tmp_path / "nope")])
    assert result.exit_code == 1 and "bash bench/genai_env.sh" in result.output


def test_bench_renders_chats_with_the_bundles_template(llama_bundle, tmp_path):
    """--chat as `specrt generate --chat` has it: messages lines are taken, a bundle without a
    template and the genai contender (plain prompts) are refused in one line."""
    bundle = chat_bundle(llama_bundle, tmp_path)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    args = ["bench", "--prompt-file", str(chats), "--no-transformers", "--json"]
    args += ["--max-new-tokens", "6", "--max-draft-tokens", "1"]
    result = CliRunner().invoke(main, [*args, "--bundle", str(bundle), "--chat"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["prompts"] == 1
    plain = CliRunner().invoke(main, [*args, "--bundle", str(bundle)])
    assert plain.exit_code == 2 and "holds chat messages: add --chat" in plain.output
    bare = CliRunner().invoke(main, [*args, "--bundle", str(llama_bundle), "--chat"])
    assert bare.exit_code == 2 and "has no chat template" in bare.output
    genai = [*args, "--bundle", str(bundle), "--chat", "--genai-python", str(tmp_path / "py")]
    refused = CliRunner().invoke(main, genai)
    assert refused.exit_code == 2 and "leave out --genai-python or --chat" in refused.output


def test_the_never_slower_bench_runs_and_reports_each_prompt(llama_bundle, tmp_path):
    """`make bench-poor`'s script on a tiny bundle: a line per prompt, the verdict, the JSON;
    it checks every output against the target alone's itself."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a b", "c d e")))
    out = tmp_path / "never_slower.json"
    args = ["--bundle", str(chat_bundle(llama_bundle, tmp_path)), "--prompt-file", str(prompts)]
    lines = bench_lines("never_slower.py", *args, "--repeats", "1", "--out", str(out))
    assert [line.split(":")[0] for line in lines[:2]] == ["prompt 1", "prompt 2"]
    assert "of the target alone)" in lines[-1] and "worst prompt" in lines[-1]
    record = json.loads(out.read_text())
    assert record["prompts"] == ["a b", "c d e"] and len(record["results"]) == 2
    assert all(len(entry["ratios"]) == 1 for entry in record["results"])
    served = bench_lines("never_slower.py", *args, "--repeats", "1", "--served")
    assert "(served): the default over its target alone, 2 prompts" in served[-1]


def test_the_engine_step_bench_times_each_graph_side_by_side(llama_bundle, tmp_path):
    """`bench/engine_step.py` on a tiny bundle's two engines: a line per call shape, each graph's
    median with its ratio to the first; a missing graph is named, not a traceback."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    graphs = [
        str(llama_bundle / role / "onnxruntime" / "model.onnx") for role in ("target", "draft")
    ]
    script = [sys.executable, str(repo / "bench" / "engine_step.py")]
    small = ["--positions", "1", "3", "--cached", "5", "--blocks", "2", "--calls", "2"]
    result = subprocess.run([*script, *graphs, *small], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()[1:]
    assert [line.split(":")[0] for line in lines] == ["1 positions after 5", "3 positions after 5"]
    for line in lines:
        assert "[0]" in line and "(1.000)" in line and "[1]" in line
    missing = subprocess.run(
        [*script, str(tmp_path / "none.onnx")], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode != 0 and "no graph at" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_the_shared_prefix_bench_prints_both_modes_and_their_ratio(llama_bundle, tmp_path):
    """`bench/shared_prefix.py` on a tiny chat bundle: both modes' tokens/s, the ratio, and the
    same tokens either way."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a b", "c d e", "f")))
    args = ["--bundle", str(chat_bundle(llama_bundle, tmp_path / "chat")), "--prompt-file",
            str(prompts), "--repeats", "1", "--max-new-tokens", "4", "--batch-size", "2",
            "--system-words", "5"]  # fmt: skip
    lines = bench_lines("shared_prefix.py", *args)
    assert "the first" in lines[0] and "alike" in lines[0]
    assert lines[-2].startswith("ratio (copied / read whole): ")
    assert lines[-1] == "outputs identical: True"


def test_the_first_calls_bench_prints_each_call_s_ratio(demo_bundle):
    """`bench/first_calls.py` on the demo pair (its chat prompts fit its positions): a line per
    call, the same output either way."""
    args = ["--bundle", str(demo_bundle), "--rows", "3", "--calls", "2", "--max-new-tokens",
            "6", "--modes", "free", "--threads", "1"]  # fmt: skip
    lines = bench_lines("first_calls.py", *args)
    assert [line.split(":")[0] for line in lines] == ["free, call 1", "free, call 2"]
    assert all("x the target alone (same output: True); rounds " in line for line in lines)


def test_the_serve_load_bench_reads_the_servers_streams(llama_bundle, tmp_path):
    """`bench/serve_load.py` against two real servers on a tiny bundle: a line per concurrency
    with both servers' rates and their ratio (every streamed chunk carries ``"usage": null``
    once usage is asked for: only the last one counts the tokens)."""
    out = tmp_path / "serve_load.json"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a b", "c d e")))
    lines = bench_lines("serve_load.py", "--bundle", str(llama_bundle), "--prompt-file",
                        str(prompts), "--requests", "3", "--max-tokens", "4", "--concurrency",
                        "2", "--batch-size", "2", "--repeats", "1", "--out", str(out))  # fmt: skip
    [line] = [line for line in lines if line.startswith("concurrency")]
    assert "speculative" in line and "target alone" in line and "ratio" in line
    [row] = json.loads(out.read_text())["rows"]
    assert all(row[mode]["tokens_per_s"] > 0 for mode in ("speculative", "target_only"))

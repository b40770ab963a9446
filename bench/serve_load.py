"""Load on `specrt serve`: speculation on vs off, at several concurrencies, side by side.

    .venv/bin/python bench/serve_load.py [--bundle engines/demo] [--concurrency 1 4 16]

Starts two servers on 127.0.0.1 (`specrt serve`'s defaults, and `--num-draft-tokens 0`), then
at each concurrency sends the same fixed set of streaming completion requests (held-out
prompts, greedy unless --temperature, max_tokens spread around --max-tokens) to one and then
the other and back (--repeats runs each), from that many client threads, each holding one
keep-alive connection;
a run stops by itself after its requests. Prints requests/s, tokens/s, p50/p99 latency and
time to first token for both and their ratio, and writes the table as JSON. Time to first
token is also given apart for the first wave (each client's first request: all of them arrive
at once) and the steady state after it (a request arrives as another finishes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def start_server(args: argparse.Namespace, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "specrt.cli", "serve", "--bundle", args.bundle]
    cmd += ["--port", str(port), "--batch-size", str(args.batch_size), *extra]
    # Two lines per request at info would bury the results printed beside them
    cmd += ["--log-level", "warning"]
    # REPO first, before what the environment adds (onnxruntime-gpu installed to a --target)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    process = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": path})
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if process.poll() is not None:  # it died (its own error is above): no minute of polling
            raise SystemExit(f"the server exited with status {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit("the server did not come up")


def one_request(
    http: httpx.Client,
    url: str,
    prompt: str,
    max_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": temperature}
    if seed is not None:
        body["seed"] = seed
    body["stream_options"] = {"include_usage": True}  # the last chunk: the tokens it counts
    started = time.perf_counter()
    first, tokens = None, 0
    with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:  # said once, not counted as a request of no tokens
            response.read()
            raise SystemExit(f"a request failed ({response.status_code}): {response.text}")
        for line in response.iter_lines():
            # Parsed only where needed: on 2 cores the clients' own Python competes with the
            # server, and would show up in the latencies measured.
            if first is None and line.startswith("data: {") and '"text": ""' not in line:
                first = time.perf_counter()
            if '"usage"' in line:  # every chunk has it (null) once include_usage asks for it
                usage = json.loads(line[6:])["usage"]
                tokens = usage["completion_tokens"] if usage else tokens
    done = time.perf_counter()
    return {"latency": done - started, "ttft": (first or done) - started, "tokens": tokens}


def run_load(
    url: str,
    work_items: list[tuple[str, int, int | None]],
    concurrency: int,
    temperature: float = 0.0,
) -> dict:
    """Every ``(prompt, max_tokens, seed)`` once, from ``concurrency`` client threads; the
    requests' measurements."""
    work: queue.Queue[tuple[str, int, int | None]] = queue.Queue()
    for item in work_items:
        work.put(item)
    results: list[dict] = []
    failed: list[str] = []

    def client() -> None:
        # One keep-alive connection per client, as load generators and SDK clients hold them
        # (a new httpx client per request spent ~40 ms building its SSL context).
        with httpx.Client(timeout=300) as http:
            for turn in itertools.count():
                try:
                    prompt, max_tokens, seed = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    measured = one_request(http, url, prompt, max_tokens, temperature, seed)
                except SystemExit as exc:
                    failed.append(str(exc))
                    return
                results.append({**measured, "turn": turn})

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failed:
        raise SystemExit(failed[0])
    return {"results": results, "wall": time.perf_counter() - started}


def summarize(runs: list[dict]) -> dict:
    """Runs of one server as one: total tokens over total time, percentiles over all requests."""
    results = [r for run in runs for r in run["results"]]
    wall = sum(run["wall"] for run in runs)
    latencies = sorted(r["latency"] for r in results)
    ttfts = sorted(r["ttft"] for r in results)
    # Each client's first request arrives with all the others' at once; the rest arrive as
    # earlier ones finish (steady state).
    steady = sorted(r["ttft"] for r in results if r["turn"] > 0) or [0.0]
    return {
        "requests_per_s": len(results) / wall,
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "runs_tokens_per_s": [
            sum(r["tokens"] for r in run["results"]) / run["wall"] for run in runs
        ],
        "p50_latency_s": statistics.median(latencies),
        "p99_latency_s": percentile(latencies, 0.99),
        "p50_ttft_s": statistics.median(ttfts),
        "p99_ttft_s": percentile(ttfts, 0.99),
        "p50_ttft_steady_s": statistics.median(steady),
        "p99_ttft_steady_s": percentile(steady, 0.99),
        "p99_ttft_first_wave_s": percentile(
            sorted(r["ttft"] for r in results if r["turn"] == 0), 0.99
        ),
    }


def percentile(ordered: list[float], fraction: float) -> float:
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def ttft(measured: dict) -> str:
    ms = {key: value * 1e3 for key, value in measured.items() if "ttft" in key}
    return (
        f"p50/p99 {ms['p50_ttft_s']:.0f}/{ms['p99_ttft_s']:.0f} ms, steady "
        f"{ms['p50_ttft_steady_s']:.0f}/{ms['p99_ttft_steady_s']:.0f} ms, first wave p99 "
        f"{ms['p99_ttft_first_wave_s']:.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", default=str(REPO / "engines" / "demo"))
    parser.add_argument(
        "--prompt-file", default=str(REPO / "models" / "demo" / "heldout_prompts.jsonl")
    )
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=128, help="Mean max_tokens.")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy.")
    parser.add_argument(
        "--seed", type=int, default=None, help="Request i is sampled with seed SEED + i."
    )
    parser.add_argument(
        "--length-spread",
        type=float,
        default=0.5,
        help="max_tokens drawn uniformly from mean x (1 -/+ this), seeded (0: all the mean).",
    )
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--batch-size", type=int, default=16)
    # Each server runs this many times per concurrency, in turns A B B A ...: this VM's speed
    # drifts between runs as much as the differences measured.
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "serve_load.json"))
    args = parser.parse_args()

    from specrt.prompts import read_prompt_file

    prompts = read_prompt_file(args.prompt_file)
    prompts = (prompts * (1 + args.requests // len(prompts)))[: args.requests]
    # Lengths spread around --max-tokens (the same for both servers): requests all of one
    # length keep the clients in lockstep, finishing and arriving again in clusters.
    spread = int(args.max_tokens * args.length_spread)
    lengths = random.Random(0).choices(
        range(args.max_tokens - spread, args.max_tokens + spread + 1), k=len(prompts)
    )
    seeds = [None if args.seed is None else args.seed + i for i in range(len(prompts))]
    work_items = list(zip(prompts, lengths, seeds))
    servers = {
        "speculative": start_server(args, []),
        "target_only": start_server(args, ["--num-draft-tokens", "0"]),
    }
    rows = []
    try:
        for _, url in servers.values():  # warm up: shapes, caches, the schedule
            run_load(url, [(prompt, 32, None) for prompt in prompts[:4]], 4)
        for concurrency in args.concurrency:
            row = {"concurrency": concurrency}
            runs: dict[str, list[dict]] = {name: [] for name in servers}
            for repeat in range(args.repeats):
                names = list(servers) if repeat % 2 == 0 else list(servers)[::-1]
                for name in names:
                    url = servers[name][1]
                    runs[name].append(run_load(url, work_items, concurrency, args.temperature))
            row.update({name: summarize(measured) for name, measured in runs.items()})
            spec, alone = row["speculative"], row["target_only"]
            row["tokens_per_s_ratio"] = spec["tokens_per_s"] / alone["tokens_per_s"]
            rows.append(row)
            print(
                f"concurrency {concurrency:2d}: speculative {spec['tokens_per_s']:7.0f} tok/s "
                f"({spec['requests_per_s']:.2f} req/s, p50/p99 latency {spec['p50_latency_s']:.2f}/"
                f"{spec['p99_latency_s']:.2f} s, TTFT {ttft(spec)})  target alone "
                f"{alone['tokens_per_s']:7.0f} tok/s (p50/p99 latency {alone['p50_latency_s']:.2f}"
                f"/{alone['p99_latency_s']:.2f} s, TTFT {ttft(alone)})  "
                f"ratio {row['tokens_per_s_ratio']:.2f}x",
                flush=True,
            )
    finally:
        for process, _ in servers.values():
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()

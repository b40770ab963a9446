"""Load on `specrt serve`: speculation on vs off, at several concurrencies, side by side.

    .venv/bin/python bench/serve_load.py [--bundle engines/demo] [--concurrency 1 4 16]

Starts two servers on 127.0.0.1 (`specrt serve`'s defaults, and `--num-draft-tokens 0`), then
at each concurrency sends the same fixed set of streaming completion requests (held-out
prompts, greedy, --max-tokens each) to one and then the other and back (--repeats runs each),
from that many client threads, each holding one keep-alive connection; a run stops by itself
after its requests. Prints requests/s,
tokens/s, p50/p99 latency and time to first token for both and their ratio, and writes the
table as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
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
    process = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit("the server did not come up")


def one_request(http: httpx.Client, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    first, tokens = None, 0
    with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            # Parsed only where needed: on 2 cores the clients' own Python competes with the
            # server, and would show up in the latencies measured.
            if first is None and line.startswith("data: {") and '"text": ""' not in line:
                first = time.perf_counter()
            if '"usage"' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    done = time.perf_counter()
    return {"latency": done - started, "ttft": (first or done) - started, "tokens": tokens}


def run_load(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """Every prompt once, from ``concurrency`` client threads; the requests' measurements."""
    work: queue.Queue[str] = queue.Queue()
    for prompt in prompts:
        work.put(prompt)
    results: list[dict] = []

    def client() -> None:
        # One keep-alive connection per client, as load generators and SDK clients hold them
        # (a new httpx client per request spent ~40 ms building its SSL context).
        with httpx.Client(timeout=300) as http:
            while True:
                try:
                    prompt = work.get_nowait()
                except queue.Empty:
                    return
                results.append(one_request(http, url, prompt, max_tokens))

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"results": results, "wall": time.perf_counter() - started}


def summarize(runs: list[dict]) -> dict:
    """Runs of one server as one: total tokens over total time, percentiles over all requests."""
    results = [r for run in runs for r in run["results"]]
    wall = sum(run["wall"] for run in runs)
    latencies = sorted(r["latency"] for r in results)
    ttfts = sorted(r["ttft"] for r in results)
    return {
        "requests_per_s": len(results) / wall,
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "runs_tokens_per_s": [
            sum(r["tokens"] for r in run["results"]) / run["wall"] for run in runs
        ],
        "p50_latency_s": statistics.median(latencies),
        "p99_latency_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "p50_ttft_s": statistics.median(ttfts),
        "p99_ttft_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", default=str(REPO / "engines" / "demo"))
    parser.add_argument(
        "--prompt-file", default=str(REPO / "models" / "demo" / "heldout_prompts.jsonl")
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
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
    servers = {
        "speculative": start_server(args, []),
        "target_only": start_server(args, ["--num-draft-tokens", "0"]),
    }
    rows = []
    try:
        for _, url in servers.values():  # warm up: shapes, caches, the schedule
            run_load(url, prompts[:4], 4, 32)
        for concurrency in args.concurrency:
            row = {"concurrency": concurrency}
            runs: dict[str, list[dict]] = {name: [] for name in servers}
            for repeat in range(args.repeats):
                names = list(servers) if repeat % 2 == 0 else list(servers)[::-1]
                for name in names:
                    url = servers[name][1]
                    runs[name].append(run_load(url, prompts, concurrency, args.max_tokens))
            row.update({name: summarize(measured) for name, measured in runs.items()})
            spec, alone = row["speculative"], row["target_only"]
            row["tokens_per_s_ratio"] = spec["tokens_per_s"] / alone["tokens_per_s"]
            rows.append(row)
            print(
                f"concurrency {concurrency:2d}: speculative {spec['tokens_per_s']:7.0f} tok/s "
                f"({spec['requests_per_s']:.2f} req/s, p50/p99 latency {spec['p50_latency_s']:.2f}/"
                f"{spec['p99_latency_s']:.2f} s, TTFT {spec['p50_ttft_s'] * 1e3:.0f}/"
                f"{spec['p99_ttft_s'] * 1e3:.0f} ms)  target alone {alone['tokens_per_s']:7.0f} "
                f"tok/s (p50/p99 latency {alone['p50_latency_s']:.2f}/{alone['p99_latency_s']:.2f}"
                f" s, TTFT {alone['p50_ttft_s'] * 1e3:.0f}/{alone['p99_ttft_s'] * 1e3:.0f} ms)  "
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

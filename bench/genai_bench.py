"""onnxruntime-genai on the demo pair, on the same held-out prompts as `specrt bench`.

Run with the environment made by bench/genai_env.sh:
    build/genai-venv/bin/python bench/genai_bench.py --models build/genai --threads 2
Prints median tokens/s (greedy, 128 new tokens, prefill included) of the target alone. Its
speculative mode is not driven yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import onnxruntime_genai as og
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parents[1]


def load(path: Path, threads: int) -> og.Model:
    config_path = path / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    config_path.write_text(json.dumps(config, indent=1))
    return og.Model(str(path))


def tokens_per_second(model: og.Model, ids: list[int], new_tokens: int) -> float:
    params = og.GeneratorParams(model)
    total = len(ids) + new_tokens
    params.set_search_options(max_length=total, min_length=total, do_sample=False)
    generator = og.Generator(model, params)
    started = time.perf_counter()
    generator.append_tokens(ids)
    count = 0
    while not generator.is_done():
        generator.generate_next_token()
        count += 1
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, default=REPO / "build" / "genai")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(str(REPO / "models" / "demo" / "tokenizer" / "tokenizer.json"))
    lines = (REPO / "models" / "demo" / "heldout_prompts.jsonl").read_text().splitlines()
    prompts = [tokenizer.encode(json.loads(line)["prompt"]).ids for line in lines]
    prompts = prompts[: args.num_prompts]
    model = load(args.models / "target", args.threads)
    tokens_per_second(model, prompts[0], 8)  # warm-up
    rates = [tokens_per_second(model, ids, args.max_new_tokens) for ids in prompts]
    report = {
        "contender": "onnxruntime-genai target only",
        "tokens_per_second": statistics.median(rates),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()

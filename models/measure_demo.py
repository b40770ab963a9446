"""Measure the demo pair as MODEL_CARD.md reports it, on the exported bundle (onnxruntime, CPU).

    python models/measure_demo.py --bundle engines/demo [--prompts 40] [--threads 2]

Prints (and writes to models/demo/measurements.json) tokens per target pass and acceptance at
K = 4 on the held-out prompts, greedy and at temperature 1, and the draft/target cost of one-token
steps on a warm cache of 256 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from specrt.bench.costs import step_seconds
from specrt.prompts import read_prompt_file
from specrt.runtime import GenerationConfig, SpeculativeGenerator
from specrt.runtime.loading import load_pair

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, default=Path("engines/demo"))
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=HERE / "demo" / "measurements.json")
    args = parser.parse_args()

    prompts = read_prompt_file(HERE / "demo" / "heldout_prompts.jsonl")[: args.prompts]
    pair = load_pair(args.bundle, threads=args.threads)
    generator = SpeculativeGenerator.from_pair(pair)
    report: dict = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "k": 4}
    for label, temperature in (("greedy", 0.0), ("temperature_1", 1.0)):
        config = GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            num_draft_tokens=4,
            proposer="model",  # the draft model's own speed-up and acceptance
            draft_schedule="fixed",
            temperature=temperature,
            seed=0,
            ignore_eos=True,
        )
        results = generator.generate(prompts, config)
        drafted = sum(r.stats.drafted_tokens for r in results)
        accepted = sum(r.stats.accepted_tokens for r in results)
        rounds = sum(r.stats.rounds for r in results)
        report[label] = {
            "tokens_per_round": sum(r.stats.new_tokens for r in results) / rounds,
            "acceptance_rate": accepted / drafted,
        }
    target = step_seconds(pair.target, context=256)
    in_loop = step_seconds(pair.draft, context=256)  # the draft's 1 thread
    threads = args.threads or os.cpu_count() or 1  # the target's default: all cores
    same_threads = load_pair(args.bundle, threads=args.threads, draft_threads=threads)
    draft = step_seconds(same_threads.draft, context=256)
    report["target_step_ms"] = target * 1e3
    report["draft_step_ms"] = draft * 1e3
    report["draft_cost_ratio"] = draft / target  # both on the same threads
    report["draft_step_ms_one_thread"] = in_loop * 1e3
    report["draft_cost_ratio_one_thread"] = in_loop / target  # as the generator runs it
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""The loop's own cost: greedy K vs the target alone, and wall time outside the models per token.

    .venv/bin/python bench/loop_cost.py [--bundle engines/demo] [--k 4] [--runs 3]

For comparing two versions of specrt side by side (run it alternately from each checkout with
PYTHONPATH pointing there): each run loads the bundle, warms up, then generates the held-out
prompts interleaved per prompt (target alone, then K) and prints one JSON line with the median
tokens/s of each, their ratio, and the microseconds per emitted token spent outside onnxruntime.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from specrt.prompts import read_prompt_file
from specrt.runtime import GenerationConfig, SpeculativeGenerator

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", default=str(REPO / "engines" / "demo"))
    parser.add_argument(
        "--prompt-file", default=str(REPO / "models" / "demo" / "heldout_prompts.jsonl")
    )
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()

    generator = SpeculativeGenerator.from_bundle(args.bundle)
    prompts = generator.encode_prompts(read_prompt_file(args.prompt_file)[: args.num_prompts])
    model = dict(proposer="model", draft_schedule="fixed")  # the draft model, K every round
    configs = {
        k: GenerationConfig(
            max_new_tokens=args.max_new_tokens, num_draft_tokens=k, ignore_eos=True, **model
        )
        for k in (0, args.k)
    }
    for config in configs.values():  # warm-up: first calls allocate
        generator.generate([prompts[0][:32]], replace(config, max_new_tokens=8))
    for _ in range(args.runs):
        rates: dict[int, list[float]] = {k: [] for k in configs}
        outside = dict.fromkeys(configs, 0.0)
        tokens = dict.fromkeys(configs, 0)
        for prompt in prompts:
            for k, config in configs.items():
                generator.forget_kept_rows()  # each K reads the prompt itself
                model_before, started = generator.model_time_s, time.perf_counter()
                [result] = generator.generate([prompt], config)
                wall = time.perf_counter() - started
                outside[k] += wall - (generator.model_time_s - model_before)
                tokens[k] += len(result.token_ids)
                rates[k].append(len(result.token_ids) / wall)
        target, speculative = (statistics.median(rates[k]) for k in configs)
        report = {
            "target_tokens_per_s": round(target, 1),
            f"k{args.k}_tokens_per_s": round(speculative, 1),
            "ratio": round(speculative / target, 3),
        }
        for k in configs:
            report[f"k{k}_us_outside_models_per_token"] = round(1e6 * outside[k] / tokens[k], 1)
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()

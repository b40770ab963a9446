"""Draft schedules side by side, paired prompt by prompt: is adaptive better than +2/-1?

    .venv/bin/python bench/schedules.py --bundle engines/demo --passes 3

Runs the target alone, fixed K (--fixed), the adaptive schedule and the heuristic one (both
capped at --k-max) on every held-out prompt, interleaved, in a rotating order, --passes times.
The schedules learn across prompts, as they do in a service (one generator for the whole run).
Prints aggregate tokens/s of each contender (all tokens / all time) and its ratio to the target
alone, then the paired comparison of adaptive against each other contender: the geometric mean
of the per-prompt time ratios with a 95% interval (t on log ratios over prompts, passes
averaged) and on how many prompts adaptive was faster. The VM's speed drifts; pairing per prompt
and interleaving cancel most of it, which a single `specrt bench` run cannot.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

from specrt.backends import ENGINE_CHOICES
from specrt.prompts import read_prompt_file
from specrt.runtime import GenerationConfig, SpeculativeGenerator

REPO = Path(__file__).resolve().parents[1]
T_975 = 1.96  # normal quantile: the prompts are many enough (>= 30) for it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", default=str(REPO / "engines" / "demo"))
    parser.add_argument(
        "--prompt-file", default=str(REPO / "models" / "demo" / "heldout_prompts.jsonl")
    )
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k-max", type=int, default=8)
    parser.add_argument("--fixed", type=int, nargs="*", default=[3, 4])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--engine", default=ENGINE_CHOICES[0], choices=ENGINE_CHOICES)
    args = parser.parse_args()

    prompts = read_prompt_file(args.prompt_file)[: args.num_prompts]
    generator = SpeculativeGenerator.from_bundle(
        args.bundle, threads=args.threads, engine=args.engine
    )
    ids = generator.encode_prompts(prompts)

    def config(k: int, schedule: str = "fixed") -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=args.max_new_tokens,
            num_draft_tokens=k,
            draft_schedule=schedule,
            proposer="model",  # the schedules of the draft model's K
            temperature=args.temperature,
            ignore_eos=True,
            seed=0,
        )

    contenders = {"target only": config(0)}
    contenders.update({f"K={k}": config(k) for k in args.fixed})
    contenders[f"adaptive K<={args.k_max}"] = config(args.k_max, "adaptive")
    contenders[f"heuristic K<={args.k_max}"] = config(args.k_max, "heuristic")
    names = list(contenders)
    for name in names:  # warm-up: first calls allocate
        generator.generate([ids[0][:16]], contenders[name])

    seconds = {name: [[0.0] * len(ids) for _ in range(args.passes)] for name in names}
    tokens = dict.fromkeys(names, 0)
    for run in range(args.passes):
        for index, prompt in enumerate(ids):
            shift = (run + index) % len(names)
            for name in names[shift:] + names[:shift]:
                generator.forget_kept_rows()  # each contender reads the prompt itself
                started = time.perf_counter()
                (result,) = generator.generate([prompt], contenders[name])
                seconds[name][run][index] = time.perf_counter() - started
                tokens[name] += result.stats.new_tokens
        print(f"pass {run + 1}/{args.passes} done", flush=True)

    total = {name: sum(map(sum, seconds[name])) for name in names}
    base = tokens["target only"] / total["target only"]
    print(
        f"\n{len(ids)} prompts x {args.passes} passes, temperature {args.temperature:g}, "
        f"engine {args.engine}"
    )
    print(f"{'contender':<18}{'tokens/s':>10}{'x target':>10}")
    for name in names:
        rate = tokens[name] / total[name]
        print(f"{name:<18}{rate:>10.1f}{rate / base:>9.2f}x")

    adaptive = names[-2]
    print(f"\n{adaptive} vs each (time ratio < 1: adaptive faster; geometric mean, 95% interval)")
    for other in names[:-2] + names[-1:]:
        logs = [
            math.log(
                sum(seconds[adaptive][r][i] for r in range(args.passes))
                / sum(seconds[other][r][i] for r in range(args.passes))
            )
            for i in range(len(ids))
        ]
        mean = statistics.fmean(logs)
        half = T_975 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else 0.0
        faster = sum(value < 0 for value in logs)
        print(
            f"  vs {other:<16} {math.exp(mean):.3f} [{math.exp(mean - half):.3f}, "
            f"{math.exp(mean + half):.3f}]  faster on {faster}/{len(logs)} prompts"
        )


if __name__ == "__main__":
    main()

"""The default configuration with a draft that does not pay, against its own target alone, prompt
by prompt: is it within 3% of the target alone on every prompt?

    make bench-poor    # or: .venv/bin/python bench/never_slower.py [--bundle B] [--repeats 8]

The bundles (`make engines/smollm2-poor/manifest.json`): SmolLM2-135M-Instruct's float32
target (`engines/smollm2-poor`) or its int4 one (`engines/smollm2-poor-int4`) with its own first
2 layers, untrained, as the draft, which keeps almost none of its drafts. `--out` writes the
results as JSON (`bench/results/never_slower*.json`: docs/performance.md's runs). The prompts
are the held-out chat prompts of `models/smollm2/heldout_prompts.jsonl`, rendered with the chat
template, greedy, 128 new tokens, EOS ignored.

Each prompt runs the target alone (A) and the default configuration (B) in the order A B B A,
``--repeats`` times, each run in a generator that has learned nothing yet (the strict case),
or with ``--served`` in one generator per configuration for the whole run, as a service's keeps
what it learned from one request to the next. Each A B B A gives a
ratio (its A's time over its B's); a prompt's speed-up is the median of its ratios, printed with
their range, so that the host's drift between runs cancels out as far as it can. Every output is
checked against the target alone's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
NEW_TOKENS = 128
LIMIT = 0.97  # the default may cost at most 3% over the target alone


def main() -> None:
    from real import chat_ids, fresh

    from specrt.runtime import GenerationConfig, SpeculativeGenerator

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=REPO / "engines" / "smollm2-poor")
    parser.add_argument(
        "--prompt-file", type=Path, default=REPO / "models" / "smollm2" / "heldout_prompts.jsonl"
    )
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument(
        "--served",
        action="store_true",
        help="One generator per configuration for the whole run (a service's), not one a run.",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not (args.bundle / "manifest.json").exists():
        raise SystemExit(
            f"no bundle at {args.bundle}: make engines/smollm2-poor/manifest.json builds it"
        )
    lines = args.prompt_file.read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][: args.num_prompts]
    generator = SpeculativeGenerator.from_bundle(args.bundle)
    ids = chat_ids(generator, args.bundle, prompts)
    settings = dict(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    configs = {"A": GenerationConfig(num_draft_tokens=0, **settings)}
    configs["B"] = GenerationConfig(**settings)  # the default
    generator.generate(ids[:1], configs["A"])  # one-off costs (first calls) out of every timing

    served = {which: fresh(generator) for which in configs}

    def run(prompt: list[int], which: str) -> tuple[float, object]:
        runner = served[which] if args.served else fresh(generator)
        started = time.perf_counter()
        [result] = runner.generate([prompt], configs[which])
        return time.perf_counter() - started, result

    record = []
    for number, prompt in enumerate(ids, 1):
        ratios, drafted, accepted, reference = [], 0, 0, None
        for _ in range(args.repeats):
            seconds = {"A": 0.0, "B": 0.0}
            for which in "ABBA":
                elapsed, result = run(prompt, which)
                seconds[which] += elapsed
                if reference is None:
                    reference = result.token_ids
                if result.token_ids != reference:
                    raise SystemExit(f"the default changed the output of prompt {number}")
                if which == "B":
                    drafted += result.stats.drafted_tokens
                    accepted += result.stats.accepted_tokens
            ratios.append(seconds["A"] / seconds["B"])
        entry = {
            "speedup": statistics.median(ratios),
            "ratios": ratios,
            "target_alone_tokens_per_s": NEW_TOKENS / (seconds["A"] / 2),
            "drafted_per_run": drafted / (2 * args.repeats),
            "accepted_per_run": accepted / (2 * args.repeats),
        }
        record.append(entry)
        print(
            f"prompt {number}: {entry['speedup']:.3f}x (ratios {min(ratios):.3f}-"
            f"{max(ratios):.3f}); drafted {entry['drafted_per_run']:.1f} tokens a run, "
            f"{entry['accepted_per_run']:.1f} kept",
            flush=True,
        )
    worst = min(entry["speedup"] for entry in record)
    verdict = "within" if worst >= LIMIT else "NOT within"
    print(
        f"\n{args.bundle.name}{' (served)' if args.served else ''}: the default over its "
        f"target alone, {len(ids)} prompts x "
        f"{args.repeats} A B B A: median {statistics.median(e['speedup'] for e in record):.3f}x, "
        f"worst prompt {worst:.3f}x ({verdict} 3% of the target alone)"
    )
    if args.out:
        args.out.write_text(json.dumps({"prompts": prompts, "results": record}, indent=1) + "\n")


if __name__ == "__main__":
    main()

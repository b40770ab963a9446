"""specrt on a real chat model, prompt by prompt, against its own target alone: the check of the
never-slower rule (issue 40) and of what the default gains on text that does not repeat.

    .venv/bin/python bench/real.py [--bundle engines/smollm2] [--num-prompts 6] [--repeats 5]

The prompts are the held-out chat prompts of `models/smollm2/heldout_prompts.jsonl` (never
trained on, never tuned on), rendered with the bundle's chat template, greedy, 128 new tokens,
EOS ignored. Every contender runs every prompt ``--repeats`` times, interleaved with the target
alone; each run starts from a generator that has learned nothing (as a fresh `specrt generate`
does: the worst case for the learners, which a service keeps across requests). A contender's
speed-up on a prompt is the median of the target alone's times over the median of its own.
Every output is checked against the target alone's. Prints a table; ``--out`` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 128
CONTENDERS = {
    "default (hybrid, adaptive, K <= 4)": {},
    "draft model, adaptive": dict(proposer="model"),
    "prompt lookup, adaptive": dict(proposer="lookup"),
}


def fresh(generator):
    """A generator over ``generator``'s loaded models that has learned nothing yet."""
    from specrt.runtime import SpeculativeGenerator

    return SpeculativeGenerator(
        generator.target, generator.draft, generator.tokenizer, generator.eos_token_ids
    )


def chat_ids(generator, bundle: Path, prompts: list[str]) -> list[list[int]]:
    from specrt.chat import ChatTemplate

    template = ChatTemplate.from_directory(bundle / "tokenizer")
    if template is None:
        raise SystemExit(f"{bundle} has no chat template: export it from a chat model")
    texts = [template.prompt([{"role": "user", "content": p}]) for p in prompts]
    return [generator.tokenizer.encode(t, add_special_tokens=False) for t in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, default=REPO / "engines" / "smollm2")
    parser.add_argument(
        "--prompt-file", type=Path, default=REPO / "models" / "smollm2" / "heldout_prompts.jsonl"
    )
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not (args.bundle / "manifest.json").exists():
        raise SystemExit(f"no bundle at {args.bundle}: run `make engines-real` first")

    from specrt.runtime import GenerationConfig, SpeculativeGenerator

    lines = args.prompt_file.read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][: args.num_prompts]
    generator = SpeculativeGenerator.from_bundle(args.bundle, threads=args.threads)
    ids = chat_ids(generator, args.bundle, prompts)
    settings = dict(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    alone = GenerationConfig(num_draft_tokens=0, **settings)
    configs = {
        name: GenerationConfig(**options, **settings) for name, options in CONTENDERS.items()
    }
    generator.generate(ids[:1], alone)  # one-off costs (first calls) out of every timing
    table: dict[str, list[float]] = {name: [] for name in configs}
    alone_rates = []
    for number, prompt in enumerate(ids, 1):
        seconds: dict[str, list[float]] = {"alone": [], **{name: [] for name in configs}}
        reference = None
        for _ in range(args.repeats):
            for name, config in [("alone", alone), *configs.items()]:
                runner = fresh(generator)
                started = time.perf_counter()
                [result] = runner.generate([prompt], config)
                seconds[name].append(time.perf_counter() - started)
                if reference is None:
                    reference = result.token_ids
                elif result.token_ids != reference:
                    raise SystemExit(f"{name} changed the output of prompt {number}")
        base = statistics.median(seconds["alone"])
        alone_rates.append(NEW_TOKENS / base)
        for name in configs:
            table[name].append(base / statistics.median(seconds[name]))
        print(f"prompt {number}/{len(ids)} done", flush=True)

    print(
        f"\n{args.bundle.name}: {len(ids)} held-out chat prompts, {NEW_TOKENS} new tokens, greedy"
    )
    print(f"target alone: {', '.join(f'{r:.1f}' for r in alone_rates)} tokens/s")
    for name, ratios in table.items():
        cells = ", ".join(f"{r:.2f}" for r in ratios)
        print(
            f"{name:38s} {cells}  (min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x)"
        )
    if args.out:
        record = {"prompts": prompts, "target_alone_tokens_per_s": alone_rates, "speedups": table}
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
